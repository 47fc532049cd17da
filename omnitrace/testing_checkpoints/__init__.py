"""Write tiny, complete model directories (no weights) that a real vLLM engine loads offline,
for tests and benchmarks: ``python -m omnitrace.testing_checkpoints {qwen2_5_omni,minicpmo}
DIR`` (docs/vllm.md, "A real engine as the test bed")."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omnitrace.testing_checkpoints._common import SAMPLING_RATE, CheckpointError
from omnitrace.testing_checkpoints.minicpmo import (
    MINICPMO_REMOTE_FILES,
    MINICPMO_SPECIAL_TOKENS,
    MiniCPMOSizes,
    write_minicpmo,
)
from omnitrace.testing_checkpoints.qwen2_5_omni import (
    QWEN2_5_OMNI_SPECIAL_TOKENS,
    Qwen2_5OmniSizes,
    write_qwen2_5_omni,
)

__all__ = [
    "CheckpointError",
    "MINICPMO_REMOTE_FILES",
    "MINICPMO_SPECIAL_TOKENS",
    "MiniCPMOSizes",
    "QWEN2_5_OMNI_SPECIAL_TOKENS",
    "Qwen2_5OmniSizes",
    "SAMPLING_RATE",
    "main",
    "write_minicpmo",
    "write_qwen2_5_omni",
]

# Each model's writer and its default sizes (printed by --sizes).
_WRITERS: dict[str, tuple[Callable[[str, Any], Path], Any]] = {
    "minicpmo": (write_minicpmo, MiniCPMOSizes),
    "qwen2_5_omni": (write_qwen2_5_omni, Qwen2_5OmniSizes),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Write a tiny checkpoint directory from the command line; return the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m omnitrace.testing_checkpoints",
        description="Write a tiny model directory (config, tokenizer, processor; no weights) "
        'that vLLM loads offline with load_format="dummy".',
    )
    parser.add_argument("model", choices=sorted(_WRITERS))
    parser.add_argument("directory", help="where to write it (made; must not hold files)")
    parser.add_argument(
        "--size",
        choices=("tiny", "released"),
        default="tiny",
        help="tiny (default, a few MB of weights) or the released model's sizes "
        "(Qwen2.5-Omni-7B's thinker; MiniCPM-o 4.5: Qwen3-8B, SigLIP-400M, Whisper-medium)",
    )
    parser.add_argument("--sizes", action="store_true", help="print the sizes used, as JSON")
    args = parser.parse_args(argv)
    writer, sizes_class = _WRITERS[args.model]
    sizes = sizes_class.released() if args.size == "released" else sizes_class()
    try:
        written = writer(args.directory, sizes)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.sizes:
        print(json.dumps(asdict(sizes)))
    print(written)
    return 0
