"""Small text bars for gauges (utilisation, memory against capacity and estimate)."""

from __future__ import annotations

from rich.text import Text


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
