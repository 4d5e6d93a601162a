"""Table cells the benchmark reports share: a number or '-', and a ratio against a baseline."""

from __future__ import annotations


def number(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def ratio(a, b, invert: bool = False) -> str:
    """a against b: a / b, or b / a where smaller is better; '-' where either is missing or zero."""
    if a is None or b is None or a == 0 or b == 0:
        return "-"
    return f"{(b / a if invert else a / b):.2f}x"
