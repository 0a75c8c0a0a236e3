"""Small formatters every rendering shares: missing values, numbers, durations (stdlib only)."""

from __future__ import annotations


def na(value: object, unit: str = "") -> str:
    """A probed figure with its unit, or ``n/a`` when the driver did not report it."""
    return "n/a" if value is None else f"{value}{unit}"


def num(value: float | None, fmt: str = ",.0f") -> str:
    """A run figure in ``fmt``, or ``–`` before it is known."""
    return "–" if value is None else format(value, fmt)


def duration(seconds: float | None, *, clock: bool = False) -> str:
    """How long: ``1h02m``, ``3m05s``, ``42s`` (``-`` when unknown) on screens; with ``clock``,
    ``H:MM:SS`` (``--:--:--`` when unknown), the fixed width of the CLI's log lines."""
    if clock:
        if seconds is None:
            return "--:--:--"
        s = int(seconds)
        return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def mfu_text(value: float | None) -> str:
    """``MFU 41%`` (one decimal under 10%), or ``MFU n/a`` on the CPU or an unknown GPU."""
    if value is None:
        return "MFU n/a"
    pct = 100 * value
    return f"MFU {pct:.1f}%" if pct < 10 else f"MFU {pct:.0f}%"
