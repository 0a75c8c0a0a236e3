"""The readiness checks as text: the CLI's table (`doctor`) and the Hardware screen's panel."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from homelab_dp.app.doctor import Check, counts, failed

MARK = {"ok": "✓", "warn": "!", "fail": "✗", "skip": "–"}
STYLE = {"ok": "green", "warn": "yellow", "fail": "bold red", "skip": "bright_black"}


def summary(checks: Sequence[Check]) -> str:
    """``1 fail · 2 warn · 8 ok · 1 skip``, then what it means."""
    n = counts(checks)
    said = " · ".join(f"{n[s]} {s}" for s in ("fail", "warn", "ok", "skip") if n[s])
    if failed(checks):
        return f"{said}: fix what failed before a run (each hint says how)"
    if n["warn"]:
        return f"{said}: ready; the warnings may cost speed or stability"
    return f"{said}: ready"


def render_doctor(checks: Sequence[Check]) -> RenderableType:
    """`homelab-dp doctor`: one row per check, its hint under its detail, then the summary."""
    table = Table(title="homelab-dp doctor", expand=False, show_lines=False)
    table.add_column("status", no_wrap=True)
    table.add_column("check", no_wrap=True)
    table.add_column("detail")
    for c in checks:
        detail = Text(c.detail)
        if c.hint:
            detail.append(f"\n→ {c.hint}", style="cyan")
        table.add_row(Text(f"{MARK[c.status]} {c.status}", style=STYLE[c.status]), c.name, detail)
    style = "bold red" if failed(checks) else "yellow" if counts(checks)["warn"] else "green"
    return Group(table, Text(summary(checks), style=style))


def checks_panel(checks: Sequence[Check]) -> RenderableType:
    """The Hardware screen's panel: a row per check (mark, name, detail with its hint under
    it), then the summary."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(no_wrap=True)
    grid.add_column(no_wrap=True)
    grid.add_column(ratio=1)
    for c in checks:
        detail = Text(c.detail, style="bright_black" if c.status == "skip" else "")
        if c.hint:
            detail.append(f"\n→ {c.hint}", style="cyan")
        name = Text(c.name, style="bold" if c.status == "fail" else "")
        grid.add_row(Text(MARK[c.status], style=STYLE[c.status]), name, detail)
    return Group(grid, Text(summary(checks), style="bold"))
