"""Signatures: the structured key every event carries, and its text form."""

from __future__ import annotations

import copy
import dataclasses
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from omnitrace.signature import InputSpec, Signature, SignatureParseError

DTYPES = st.sampled_from(["float32", "bfloat16", "bool", "int64"])
SHAPES = st.lists(st.integers(0, 4096), max_size=4).map(tuple)


@st.composite
def signatures(draw: st.DrawFn) -> Signature:
    device = draw(st.sampled_from(["cuda:0", "cuda:1", "cpu"]))
    inputs = draw(
        st.lists(st.one_of(st.none(), st.builds(InputSpec, DTYPES, SHAPES, st.just(device))))
    )
    stream = draw(st.one_of(st.none(), st.integers(0, 2**63 - 1)))
    return Signature(tuple(inputs), stream)


def test_text_names_each_input_then_the_shared_device_and_the_stream() -> None:
    """The text form lists dtype[shape] or None per input, then @device and s=stream."""
    sig = Signature(
        (InputSpec("bfloat16", (1, 1024, 1152), "cuda:0"), None, InputSpec("bool", (), "cuda:0")),
        94,
    )
    assert sig.text == "bfloat16[1,1024,1152], None, bool[] @cuda:0 s=94"
    assert str(sig) == sig.text
    assert sig.device == "cuda:0"
    assert sig.dtypes == ("bfloat16", "bool")


def test_mixed_devices_have_no_device_suffix() -> None:
    """Inputs on two devices name no device in the text (the old key text did the same)."""
    sig = Signature((InputSpec("float32", (2,), "cpu"), InputSpec("float32", (2,), "cuda:0")))
    assert sig.device is None
    assert sig.text == "float32[2], float32[2]"


@given(signatures())
def test_text_parses_back_to_the_same_signature(sig: Signature) -> None:
    """parse(text) restores every field the text holds (a shared device, the stream)."""
    parsed = Signature.parse(sig.text)
    assert parsed.text == sig.text
    if any(spec is not None for spec in sig.inputs):
        assert parsed == sig


@pytest.mark.parametrize("text", ["k", "float32[1", "float32[1] @", "float32[-1]", "f[1] x"])
def test_texts_in_another_format_are_refused(text: str) -> None:
    """A text that is not a signature's raises SignatureParseError naming it."""
    with pytest.raises(SignatureParseError, match="not a signature"):
        Signature.parse(text)


def test_signatures_are_hashable_plain_data() -> None:
    """Equal signatures hash equal (coverage keys by them) and hold only str, int, tuple."""
    a = Signature.parse("float32[1,80,100] @cuda:0 s=7")
    b = Signature((InputSpec("float32", (1, 80, 100), "cuda:0"),), 7)
    assert a == b
    assert hash(a) == hash(b)
    assert {a: 1}[b] == 1
    assert a.inputs[0] is not None
    assert a.inputs[0].numel == 8000


def test_the_hash_is_computed_once_and_kept() -> None:
    """A signature computes its hash on first use only; equal signatures still hash equal."""
    sig = Signature.parse("float32[1,80,100] @cuda:0 s=7")
    assert sig._hash is None
    first = hash(sig)
    assert sig._hash == first == hash((sig.inputs, sig.stream))
    object.__setattr__(sig, "_hash", 12345)
    assert hash(sig) == 12345  # read back, not recomputed
    assert sig == Signature.parse("float32[1,80,100] @cuda:0 s=7")  # not compared


def test_the_kept_hash_leaves_out_of_pickles_and_copies(tmp_path: Path) -> None:
    """A pickled signature hashes as the reading process computes it, not as the writer did."""
    sig = Signature.parse("bfloat16[1,1024,1152], None @cuda:0 s=94")
    hash(sig)
    assert copy.copy(sig)._hash is None
    assert dataclasses.replace(sig, stream=3)._hash is None
    path = tmp_path / "sig.pickle"
    path.write_bytes(pickle.dumps(sig))
    # String hashes differ between processes: another seed must find the signature by hash.
    script = (
        "import pickle, sys\n"
        "from omnitrace.signature import Signature\n"
        "sig = pickle.loads(open(sys.argv[1], 'rb').read())\n"
        "fresh = Signature.parse('bfloat16[1,1024,1152], None @cuda:0 s=94')\n"
        "assert sig == fresh and {fresh: 1}[sig] == 1, 'stale hash'\n"
        "print(hash(sig) == hash(fresh))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(path)],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONHASHSEED": "1234"},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "True"


def test_a_signature_covers_one_no_larger_in_any_dimension_and_alike_otherwise() -> None:
    """covers: same count, dtypes, ranks, devices, absent inputs and stream; every dimension
    at least as large. Anything else, a larger dimension of the other's included, does not."""

    def sig(*inputs: InputSpec | None, stream: int | None = 7) -> Signature:
        return Signature(tuple(inputs), stream)

    big = sig(InputSpec("bfloat16", (4, 80, 3000), "cuda:0"), None)
    assert big.covers(big)
    assert big.covers(sig(InputSpec("bfloat16", (3, 80, 1000), "cuda:0"), None))
    for other in (
        sig(InputSpec("bfloat16", (5, 80, 1000), "cuda:0"), None),  # one dimension larger
        sig(InputSpec("float16", (3, 80, 1000), "cuda:0"), None),  # dtype
        sig(InputSpec("bfloat16", (3, 80), "cuda:0"), None),  # rank
        sig(InputSpec("bfloat16", (3, 80, 1000), "cuda:1"), None),  # device
        sig(InputSpec("bfloat16", (3, 80, 1000), "cuda:0"), None, stream=8),  # stream
        sig(InputSpec("bfloat16", (3, 80, 1000), "cuda:0")),  # count
        sig(InputSpec("bfloat16", (3, 80, 1000), "cuda:0"), InputSpec("int64", (3,), "cuda:0")),
    ):
        assert not big.covers(other), other
