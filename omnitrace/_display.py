"""Untrusted text (from an event log, a model, an environment variable) made safe to show on a
terminal and in rich: control characters and markup escaped, one line kept
(docs/architecture.md, "The core", says what each escape prevents)."""

from __future__ import annotations

import re

__all__ = ["safe", "safe_markup"]

# C0 controls, DEL and C1 controls (ESC, BEL, CR, LF, TAB, CSI U+009B included), the
# bidirectional embeddings, overrides and isolates, and the Unicode line and paragraph
# separators (a new line to some terminals and editors).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED.get(char)
    if named is not None:
        return named
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def safe(value: object) -> str:
    """Return ``str(value)`` with each control character written as a visible escape.

    ``"a\\x1b[31mb\\x07"`` becomes ``a\\x1b[31mb\\x07`` shown literally (backslash, x, 1,
    b...): nothing reaches the terminal as a control, and the result is one line.
    """
    text = value if isinstance(value, str) else str(value)
    return _UNSAFE.sub(_escape, text)


def safe_markup(value: object) -> str:
    """Return :func:`safe` text with rich markup escaped, for use inside a markup string."""
    from rich.markup import escape

    return escape(safe(value))
