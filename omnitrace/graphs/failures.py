"""What a failed capture reports: a bounded message without tensor values, and the refusal of
every later call, chained to the original error."""

from __future__ import annotations

import re

from omnitrace.config import EncoderGraphFailedError

__all__ = ["MESSAGE_MAX_CHARS", "failure_message", "terminal_error"]

#: Longest capture-failure message put in events, logs and spans.
MESSAGE_MAX_CHARS = 300
# The start of a tensor or array repr, and long bracketed runs of numbers: model values
# that an exception message may carry and that must not reach telemetry.
_TENSOR_START = re.compile(r"\b(?:tensor|array|Parameter containing:\s*tensor)\(")
_PAREN = re.compile(r"[()]")
_NUMBERS = re.compile(r"\[[-+0-9.eE,\s\[\]]{24,}\]")


def _strip_values(text: str) -> str:
    """Replace the contents of tensor reprs and long number lists in ``text`` with ``...``."""
    out: list[str] = []
    pos = 0
    while (start := _TENSOR_START.search(text, pos)) is not None:
        out.append(text[pos : start.end()])
        depth, end = 1, len(text)
        for paren in _PAREN.finditer(text, start.end()):
            depth += 1 if paren.group() == "(" else -1
            if depth == 0:
                end = paren.end()
                break
        out.append("...)")
        pos = end
    out.append(text[pos:])
    return _NUMBERS.sub("[...]", "".join(out))


def failure_message(exc: BaseException) -> str:
    """Return the first line of ``exc``'s message, bounded and without tensor values.

    At most :data:`MESSAGE_MAX_CHARS` characters are kept; what is cut (the rest of the
    line and any further lines) is counted as ``... [+N chars]``.
    """
    try:
        text = str(exc)
    except Exception:  # a broken __str__ must not hide the capture failure
        return f"<unprintable {type(exc).__name__}>"
    text = _strip_values(text).strip()
    first = text.split("\n", 1)[0].rstrip()
    kept = first[:MESSAGE_MAX_CHARS]
    cut = len(text) - len(kept)
    return f"{kept} ... [+{cut} chars]" if cut else kept


def terminal_error(
    name: str, failure: str | None, cause: BaseException | None
) -> EncoderGraphFailedError:
    """The error that refuses a call of adapter ``name`` after its capture failed.

    ``failure`` is the failure as text (type and message); ``cause`` the original exception:
    a background preparation's exception reached no caller, so the refusal carries it.
    """
    error = EncoderGraphFailedError(
        f"encoder graph {name!r} is unusable: its CUDA graph capture failed "
        f"({failure}). Restart the worker, optionally with encoder graphs "
        "disabled (--hf-overrides '{\"encoder_cuda_graph\": false}')."
    )
    error.__cause__ = cause
    return error
