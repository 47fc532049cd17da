"""Human-readable quantities, shared by the live view and the command line."""

from __future__ import annotations

__all__ = ["format_bytes"]


def format_bytes(value: int | None) -> str:
    """Format bytes with a binary unit: ``1.0 GiB``; ``—`` when unknown.

    Args:
        value: a number of bytes, or None when unknown. GiB is the largest unit.
    """
    if value is None:
        return "—"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
