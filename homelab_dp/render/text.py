"""Small formatters every rendering shares: missing values, numbers, durations (stdlib only).

Small text bars for gauges (utilisation, memory against capacity and estimate).
"""

from __future__ import annotations

from rich.text import Text

from homelab_dp.byte_units import format_bytes


def na(value: object, unit: str = "") -> str:
    """A probed figure with its unit, or ``n/a`` when the driver did not report it."""
    return "n/a" if value is None else f"{value}{unit}"


def memory(value: int | None) -> str:
    """A measured memory figure (``1.50 GiB``), or ``–`` when none was measured."""
    return "–" if value is None else format_bytes(value)


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


def gauge(fraction: float | None, width: int, style: str = "green") -> Text:
    """A filled bar for a fraction in [0, 1]; shaded grey when unknown."""
    if fraction is None:
        return Text("·" * width, style="bright_black")
    cells = round(max(0.0, min(fraction, 1.0)) * width)
    return Text("█" * cells, style=style) + Text("░" * (width - cells), style="bright_black")


def load_style(fraction: float | None) -> str:
    """Green while there is room, yellow when tight, red when (nearly) full."""
    if fraction is None:
        return "bright_black"
    return "red" if fraction > 0.95 else "yellow" if fraction > 0.85 else "green"


def memory_gauge(used: int | None, total: int | None, estimate: int | None, width: int) -> Text:
    """Used memory against capacity, with ``│`` where the plan's estimate lies."""
    if not used or not total:
        return gauge(None, width)
    bar = gauge(used / total, width, load_style(used / total))
    if estimate:
        at = min(round(estimate / total * width), width - 1)
        marker_style = "bold red" if estimate > total else "bold white"
        bar = bar[:at] + Text("│", style=marker_style) + bar[at + 1 :]
    return bar
