"""A preset's recorded runs: the table `presets show` prints, and the plan's "expected" line
(the CLI's `plan` and the TUI's plan pane share it)."""

from __future__ import annotations

import time
from typing import Any

from rich.text import Text

from homelab_dp.byte_units import format_bytes
from homelab_dp.render.text import duration, num
from homelab_dp.runs.preset_results import PresetRuns

COLUMNS = ("date", "run", "devices", "batch", "tokens/s", "MFU", "peak/GPU", "energy", "wall",
           "steps", "loss", "eval loss")  # fmt: skip


def about(seconds: float) -> str:
    """A rough duration: ``~2 h 05 min``, ``~12 min``, ``~1 min 40 s``, ``~40 s``."""
    s = int(round(seconds))
    if s >= 3600:
        return f"~{s // 3600} h {s % 3600 // 60:02d} min"
    if s >= 600:
        return f"~{round(s / 60)} min"
    if s >= 60:
        return f"~{s // 60} min {s % 60:02d} s"
    return f"~{s} s"


def _devices(fp: dict[str, Any]) -> str:
    names = fp.get("devices") or []
    if not names:
        return "–"
    if len(set(names)) == 1:
        return f"{len(names)}× {names[0]}"
    return " + ".join(names)


def _cells(r: dict[str, Any]) -> list[str]:
    fp = r.get("fingerprint") or {}
    peaks = r.get("peak_memory_bytes") or []
    mfu = r.get("mfu")
    loss, ev = r.get("final_loss"), r.get("eval_loss")
    return [
        time.strftime("%Y-%m-%d %H:%M", time.localtime(r.get("time") or 0)),
        str(r.get("run_id") or "–"),
        _devices(fp),
        f"{fp.get('micro_batch')}×{fp.get('grad_accum')}×{fp.get('world_size')} @{fp.get('seq_len')}",
        num(r.get("tokens_per_s")),
        "n/a" if mfu is None else f"{100 * mfu:.1f}%",
        format_bytes(max(peaks)) if peaks else "–",
        f"{r['energy_wh']:.1f} Wh" if r.get("energy_wh") else "–",
        duration(r.get("wall_s")),
        f"{r.get('steps')}/{r.get('total_steps')}",
        num(loss, ".4f"),
        num(ev, ".4f"),
    ]


def results_lines(records: list[dict[str, Any]]) -> list[str]:
    """The recorded runs as an aligned table, newest last (a line saying none when empty).
    ``batch`` is micro-batch × accumulation × processes @ sequence length; peak/GPU is the
    largest rank's peak (tensor bytes on the CPU)."""
    if not records:
        return ["No recorded runs yet: a run of this preset that completes records its results "
                "here (failed and interrupted runs are not recorded)."]  # fmt: skip
    rows = [list(COLUMNS), *(_cells(r) for r in records)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def expected_text(runs: PresetRuns | None) -> Text | None:
    """The plan's expected duration and energy from the preset's recorded runs; what they say
    when only other hardware or settings were recorded; None when nothing was recorded."""
    if runs is None or not (runs.same or runs.other):
        return None
    e = runs.expectation
    if e is None:
        what = "ran on other hardware or settings" if not runs.same else "measured no speed"
        n = len(runs.other) if not runs.same else len(runs.same)
        out = Text(
            f"expected: nothing yet — {n} recorded run(s) of {runs.preset} {what}", style="dim"
        )
        if runs.differences and not runs.same:
            out.append(f" (the newest: {'; '.join(runs.differences)})", style="dim")
        return out
    out = Text("expected: ", style="bold")
    energy = "energy not measured" if e.energy_wh is None else f"~{e.energy_wh:,.1f} Wh"
    out.append(f"{about(e.duration_s)}, {energy}", style="bold")
    steps = "the preset's" if e.steps_from == "preset" else "as the recorded runs"
    out.append(f" (from {e.from_runs} run{'s' if e.from_runs != 1 else ''} on these devices and "
               f"settings, median {e.tokens_per_s:,.0f} tokens/s; {e.steps:,} steps ({steps}) × "
               f"~{e.tokens // max(e.steps, 1):,} tokens)")  # fmt: skip
    if runs.other:
        out.append(f"; {len(runs.other)} more on other hardware or settings", style="dim")
    return out
