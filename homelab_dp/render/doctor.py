"""The readiness checks as text: the CLI's table (`doctor`) and the Hardware screen's panel."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from homelab_dp.run.doctor import Check, counts, failed

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


def checks_text(checks: Sequence[Check]) -> Text:
    """The Hardware screen's panel: a line per check, its hint under it, then the summary."""
    width = max((len(c.name) for c in checks), default=0)
    out = Text()
    for c in checks:
        out.append(f"{MARK[c.status]} ", style=STYLE[c.status])
        out.append(f"{c.name:<{width}}  ", style="bold" if c.status == "fail" else "")
        out.append(f"{c.detail}\n", style="bright_black" if c.status == "skip" else "")
        if c.hint:
            out.append(f"  → {c.hint}\n", style="cyan")
    out.append(summary(checks), style="bold")
    return out
