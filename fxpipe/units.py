"""Text for quantities, the one formatter of each: bytes, FLOPs, milliseconds, plurals.

Used by the plan views, the planner's and the search's messages, and the training progress.
"""

from __future__ import annotations


def human_bytes(n: float, decimal: bool = False) -> str:
    """Format a byte count: binary prefixes ``0 B``, ``512 B``, ``1.5 KiB``, ``3.0 GiB`` (tables,
    dumps), or with ``decimal`` SI prefixes ``9.1 GB``, ``512 MB``, ``3 B`` (the unit of the spec's
    ``cluster.memory_gb``, so memory advice reads in the user's unit).

    Args:
        n: bytes (int or float; negative values are formatted with a minus sign).
        decimal: powers of 1000 and 3 significant digits instead of powers of 1024.
    """
    if decimal:
        n = float(n)
        for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
            if abs(n) >= scale:
                return f"{n / scale:.3g} {unit}"
        return f"{n:.3g} B"
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    if n < 1024:
        return f"{sign}{int(round(n))} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        n /= 1024.0
        if n < 1024 or unit == "PiB":
            return f"{sign}{n:.1f} {unit}"
    raise AssertionError("unreachable")


def human_flops(n: float) -> str:
    """Format a FLOP count with SI prefixes (10^3 steps): ``0``, ``950``, ``12.3 M``, ``1.23 G``."""
    n = float(n)
    if n == 0:
        return "0"
    for scale, unit in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.3g}"


def plural(n: int, word: str) -> str:
    """``"1 stage"``, ``"2 stages"``, ``"0 stages"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def ms(seconds: float) -> str:
    """Seconds -> milliseconds text with about 4 significant digits, fixed decimals per range."""
    ms = seconds * 1e3
    if ms == 0:
        return "0"
    if abs(ms) >= 100:
        return f"{ms:.1f}"
    if abs(ms) >= 0.01:
        return f"{ms:.3f}"
    return f"{ms:.2e}"
