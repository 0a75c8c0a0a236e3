"""The serving plan as text: `serve --plan` (a table per device) and the TUI's plan section."""

from __future__ import annotations

from collections.abc import Collection

from rich.console import Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from homelab_dp.app.serve import ServePlanned
from homelab_dp.byte_units import format_bytes
from homelab_dp.planning.model_spec import ModelSpec
from homelab_dp.planning.plan_reasons import count
from homelab_dp.planning.serve_plan import ServePlan


def kv_formula(spec: ModelSpec, plan: ServePlan) -> str:
    """The KV cache's formula in words, with this model's numbers."""
    return (
        f"keys and values × {spec.layers} layers × {spec.kv_heads} KV heads × {spec.head_dim} "
        f"head dim × {plan.context} tokens × {plan.concurrent} sequences × "
        f"{plan.bytes_per_param:g} bytes"
    )


def breakdown_rows(spec: ModelSpec, plan: ServePlan) -> list[tuple[str, int, str]]:
    """(term, bytes, how it is computed) for each part of one replica."""
    dtype = "16-bit" if plan.bytes_per_param == 2 else "fp32"
    return [
        ("weights", plan.weights_bytes, f"{count(plan.params)} params × {plan.bytes_per_param:g} B ({dtype})"),
        ("KV cache", plan.kv_cache_bytes, kv_formula(spec, plan)),
        ("activations", plan.activation_bytes,
         f"prefill of {plan.context} tokens, one layer at a time "
         f"({format_bytes(plan.prefill_bytes)}) + last-position fp32 logits and probabilities "
         f"of {plan.concurrent} sequences ({format_bytes(plan.logits_bytes)})"),
        ("overhead", plan.overhead_bytes,
         "CUDA context + fragmentation (assumed)" if plan.kind == "cuda"
         else "Python/torch runtime + fragmentation (assumed)"),
    ]  # fmt: skip


def _replica_mark(fits: bool, started: bool | None) -> Text:
    if started is None:  # no choice made (the TUI): auto starts one wherever a copy fits
        started = fits
    return Text("yes", style="green") if started else Text("no", style="red" if not fits else "")


def device_table(plan: ServePlan, started: Collection[int] | None = None) -> Table:
    """One row per device: memory, per-replica budget, copies that fit, whether it serves.

    ``started``: positions of the devices given a replica (None: every one a copy fits on)."""
    table = Table(box=None, pad_edge=False)
    for col, right in (("device", False), ("memory", True), ("per replica", True),
                       ("copies fit", True), ("replica?", False)):  # fmt: skip
        table.add_column(col, justify="right" if right else "left")
    for i, d in enumerate(plan.devices):
        table.add_row(
            d.name,
            format_bytes(d.memory_bytes),
            format_bytes(plan.per_replica_bytes),
            Text(str(d.copies_fit), style="green" if d.copies_fit else "red"),
            _replica_mark(d.copies_fit >= 1, None if started is None else i in started),
        )
    return table


def _started(planned: ServePlanned) -> list[int]:
    """Positions of the devices the picked replicas run on (the first N that hold a copy)."""
    holding = [i for i, d in enumerate(planned.plan.devices) if d.copies_fit >= 1]
    return holding[: len(planned.replicas)]


def render_serve_plan(planned: ServePlanned) -> Group:
    """The `serve --plan` text: the devices, one replica's breakdown and the reasons."""
    plan, spec = planned.plan, planned.spec
    n = len(planned.replicas)
    head = Text()
    head.append(" SERVES " if plan.fits else " DOES NOT FIT ",
                style="bold black on green" if plan.fits else "bold white on red")  # fmt: skip
    replicas = f"{n} replica(s) · " if plan.fits else ""
    head.append(f" {planned.ref.name} · {replicas}{planned.dtype} · context "
                f"{plan.context} × {plan.concurrent} concurrent\n", style="bold")  # fmt: skip
    head.append(f"{plan.kind}: {planned.source}", style="bright_black")
    parts = Table(title="One replica", box=None, pad_edge=False, title_justify="left")
    parts.add_column("term")
    parts.add_column("bytes", justify="right")
    parts.add_column("how")
    for term, size, how in breakdown_rows(spec, plan):
        parts.add_row(term, format_bytes(size), Text(how, style="bright_black"))
    parts.add_row(
        Text("total", style="bold"), Text(format_bytes(plan.per_replica_bytes), style="bold"), ""
    )
    reasons = Text("\n".join(f"• {r}" for r in plan.reasons))
    return Group(
        Panel(head, title="serving plan", expand=False),
        device_table(plan, _started(planned)),
        Text(),
        parts,
        Text(),
        Panel(reasons, title="why", expand=False),
    )


def serve_plan_text(spec: ModelSpec, plan: ServePlan, title: str = "Serving the result") -> Text:
    """The serving plan as one Text (the TUI's Plan screen): a line per device, the breakdown
    and the reasons, narrow enough for a side pane."""
    out = Text(f"{title}\n", style="bold")
    if plan.fits:
        out.append(" SERVES ", style="bold black on green")
        out.append(
            f" {plan.replicas} replica(s), one per {'card' if plan.kind == 'cuda' else 'process'}"
        )
    else:
        out.append(" DOES NOT FIT ONE CARD ", style="bold white on red")
    out.append(f" · context {plan.context} × {plan.concurrent} concurrent\n")
    for d in plan.devices:
        mark = ("▶ ", "bold cyan") if d.copies_fit >= 1 else ("  ", "")
        out.append(mark[0], style=mark[1])
        out.append(f"{d.name}: {format_bytes(d.memory_bytes)}, ")
        out.append(f"{d.copies_fit} cop{'y' if d.copies_fit == 1 else 'ies'} fit",
                   style="green" if d.copies_fit else "red")  # fmt: skip
        out.append(f" · replica {'yes' if d.copies_fit >= 1 else 'no'}\n")
    out.append(f"per replica {format_bytes(plan.per_replica_bytes)} = ", style="bold")
    out.append(
        " + ".join(f"{term} {format_bytes(size)}" for term, size, _ in breakdown_rows(spec, plan))
    )
    out.append(f"\nKV cache: {kv_formula(spec, plan)}\n", style="bright_black")
    for reason in plan.reasons[1:]:  # the first restates the breakdown above
        out.append(f"• {reason}\n")
    return out
