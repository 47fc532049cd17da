"""Signatures: the structured key every event carries, and its text form."""

from __future__ import annotations

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
