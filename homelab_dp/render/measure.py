"""The measure table: per rank and phase, measured peak beside the plan's estimate."""

from __future__ import annotations

from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from homelab_dp.app.measure import MeasureReport
from homelab_dp.byte_units import format_bytes
from homelab_dp.planning.memory.device_memory import PHASES


def render_measure(report: MeasureReport) -> Any:
    """Per rank and phase: measured peak beside the estimate; the split at the peak."""
    est = report.plan.get("phase_tensor_bytes") or {}
    kind = report.memory["kind"]
    what = "peak live tensor bytes" if kind == "live_tensor_bytes" else "max_memory_allocated"
    t = report.plan["training"]
    title = (f"{report.plan['method']} · {report.plan['distribution']} · micro-batch "
             f"{t['micro_batch']} × accumulation {t['grad_accum']} · seq_len {t['seq_len']}"
             f"{' · checkpointing' if t['activation_checkpointing'] else ''} — {what}")  # fmt: skip
    phases = Table(title=title)
    for col in ("rank", "phase", "estimate", "measured", "error", "end of phase"):
        phases.add_column(col, justify="left" if col in ("rank", "phase") else "right")
    for r in report.memory["ranks"]:
        for ph in PHASES:
            got = r["phases"].get(ph)
            if got is None:
                continue
            e = est.get(ph)
            # The load estimate is what stays after loading; loading itself has transients.
            seen = got["end_bytes"] if ph == "load" else got["peak_bytes"]
            err = f"{100 * (e - seen) / max(seen, 1):+.1f}%" if e else "–"
            label = "load (after)" if ph == "load" else ph
            label += " ◀ peak" if ph == r.get("peak_phase") else ""
            phases.add_row(str(r["rank"]), label, format_bytes(e) if e else "–",
                           format_bytes(seen), err, format_bytes(got["end_bytes"]))  # fmt: skip
    parts = Table(title="At the peak, by component (largest rank)")
    for col in ("component", "estimate", "measured"):
        parts.add_column(col, justify="left" if col == "component" else "right")
    top = max(report.memory["ranks"], key=lambda r: r["peak_bytes"])
    per, got = report.plan["per_device_bytes"], top.get("peak_by_category") or {}
    rows = (("weights", ["weights"], ["weights"]), ("gradients", ["gradients"], ["gradients"]),
            ("optimizer state", ["optimizer"], ["optimizer"]),
            ("activations, logits, buffers, temporaries",
             ["activations", "logits", "buffers"], ["buffers", "other"]))  # fmt: skip
    for label, mine, theirs in rows:
        measured = format_bytes(sum(got.get(k, 0) for k in theirs)) if got else "n/a"
        parts.add_row(label, format_bytes(sum(per[k] for k in mine)), measured)
    summary = Text(
        f"peak: estimate {format_bytes(report.estimate_tensor_bytes)} "
        f"({report.plan.get('peak_phase')}), measured {format_bytes(report.measured_tensor_bytes)} "
        f"({top.get('peak_phase')}), error {100 * report.error:+.1f}% · run {report.run_id}"
    )
    blocks: list[Any] = [phases, parts, summary]
    if report.stored:
        blocks.append(
            Text(f"stored for this hardware in {report.stored}; later plans show it", style="dim")
        )
    return Group(*blocks)
