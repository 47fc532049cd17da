"""Start ``vllm serve`` on a written checkpoint and give it media, for tests and benchmarks: a
free port, the ``vllm`` command line, and images and clips as data URLs."""

from __future__ import annotations

import base64
import io
import json
import socket
import sys
import wave
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "data_url",
    "free_port",
    "png",
    "serve_command",
    "vllm_command",
    "wav",
]


def free_port() -> int:
    """A TCP port free on loopback now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def vllm_command() -> list[str]:
    """The ``vllm`` command of the environment this runs in.

    Its console script where pip installed one, else the module that script runs (an
    environment that has vLLM on ``PYTHONPATH`` only): the same ``main()`` either way.
    """
    script = Path(sys.executable).with_name("vllm")
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def serve_command(
    model: str | Path,
    port: int,
    *,
    max_model_len: int,
    max_num_seqs: int,
    hf_overrides: Mapping[str, Any],
    extra: Sequence[str] = (),
) -> list[str]:
    """``vllm serve`` of ``model`` on 127.0.0.1:``port``, dummy weights, seed 0, two images
    and two clips a prompt at most, no video."""
    return [
        *vllm_command(),
        "serve",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--load-format",
        "dummy",
        "--seed",
        "0",
        "--max-model-len",
        str(max_model_len),
        "--max-num-seqs",
        str(max_num_seqs),
        "--limit-mm-per-prompt",
        json.dumps({"image": 2, "audio": 2, "video": 0}),
        "--hf-overrides",
        json.dumps(dict(hf_overrides)),
        *extra,
    ]


def data_url(kind: str, payload: bytes) -> str:
    """``payload`` as a ``data:`` URL of MIME type ``kind``."""
    return f"data:{kind};base64,{base64.b64encode(payload).decode()}"


def png(picture: Any) -> bytes:
    """A PIL image as PNG bytes."""
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return buffer.getvalue()


def wav(samples: Any, rate: int) -> bytes:
    """Mono samples in [-1, 1] as 16-bit PCM WAV bytes (vLLM reads them with soundfile)."""
    import numpy as np

    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buffer.getvalue()
