"""The plan as text: the CLI's `plan` output and the TUI's plan pane, over one memory bar."""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from homelab_dp.app.plan import Planned, planned_samples
from homelab_dp.byte_units import format_bytes
from homelab_dp.planning.memory.device_memory import COMPONENTS
from homelab_dp.planning.memory.offload_cost import ASSUMED_MFU, offload_words, seconds
from homelab_dp.planning.plan_hardware import PlanHardware
from homelab_dp.planning.plan_reasons import PLAIN, count, holders
from homelab_dp.planning.planner import SAFETY_MARGIN, Plan
from homelab_dp.planning.seq_len_finder import SeqLenFinder
from homelab_dp.render.preset_results import expected_text
from homelab_dp.render.text import duration
from homelab_dp.runs.preset_results import PresetRuns

COLOURS = {
    "weights": "blue",
    "gradients": "magenta",
    "optimizer": "yellow",
    "activations": "green",
    "logits": "cyan",
    "buffers": "bright_black",
    "overhead": "red",
}
BAR_WIDTH = 32


def memory_bar(per_device: dict[str, int], capacity: int, *, mark_over: bool = True) -> Text:
    """A stacked bar of the memory components against one device's capacity; ``mark_over``
    ends a bar over capacity with ``◀ over`` (the TUI leaves it out: the line would wrap)."""
    total = per_device["total"]
    scale = max(total, capacity)
    bar = Text()
    used_cells = 0
    for comp in (*COMPONENTS, "overhead"):
        cells = round(BAR_WIDTH * per_device[comp] / scale)
        bar.append("█" * cells, style=COLOURS[comp])
        used_cells += cells
    cap_cell = round(BAR_WIDTH * capacity / scale)
    if used_cells < cap_cell:
        bar.append("░" * (cap_cell - used_cells), style="bright_black")
    elif total > capacity and mark_over:
        bar.append(" ◀ over", style="bold red")
    return bar


def legend(per_device: dict[str, int]) -> Text:
    """The bar's colours with each component's size."""
    out = Text()
    for comp in (*COMPONENTS, "overhead"):
        out.append("█ ", style=COLOURS[comp]).append(f"{comp} {format_bytes(per_device[comp])}  ")
    out.append("░ free", style="bright_black")
    return out


def render_plan(
    plan: Plan, expected: PresetRuns | None = None, samples: dict[str, Any] | None = None
) -> RenderableType:
    """The decision, the memory of every device, every candidate, reasons and advice; with
    ``expected`` (`runs.preset_results.expected_runs`), what the preset's recorded runs say;
    with ``samples`` (`app.plan.planned_samples`), what samples while training add."""
    j = plan.to_json()
    t = j["training"]
    ok = "[bold green]FITS[/]" if plan.fits else "[bold red]DOES NOT FIT[/]"
    ck = ", activation checkpointing" if t["activation_checkpointing"] else ""
    ck += ", tiled MLP" if j.get("tiled_mlp") else ""
    ck += f", offload {off}" if (off := offload_label(j)) else ""
    head = (
        f"{ok}  {PLAIN[j['method']]} · {PLAIN[j['distribution']]}{ck}\n"
        f"model {count(j['model']['params'])} params{active_words(j['model'])} "
        f"({count(j['model']['trainable_params'])} trainable) · "
        f"micro-batch {t['micro_batch']} × {data_ranks(t)} × accumulation "
        f"{t['grad_accum']} = effective batch {t['effective_batch']} · seq_len {t['seq_len']}"
        f"{split_words(t)} · "
        f"{t['dtype']} · lr {j['lr']['applied']:.3g}"
    )
    per = j["per_device_bytes"]
    measured = (j.get("calibration") or {}).get("measured")
    devices = Table(title=f"Memory per device at the {j['peak_phase']} peak", box=None)
    devices.add_column("device")
    devices.add_column("budget")
    devices.add_column("estimate / capacity", justify="right")
    if measured:  # this very configuration was measured here: show it beside the estimate
        devices.add_column("tensors: estimate / measured", justify="right")
    limited = plan.hardware.limited(SAFETY_MARGIN)
    for i, d in enumerate(plan.hardware.devices):
        cap, of = d.memory_bytes, format_bytes(d.memory_bytes)
        if i in limited:  # others hold memory: the run has what is free
            cap = d.free_bytes or 0
            of = f"{format_bytes(cap)} free"
        row = [d.name, memory_bar(per, cap), f"{format_bytes(per['total'])} / {of}"]
        if measured:
            row.append(f"{format_bytes(measured['estimate_tensor_bytes'])} / "
                       f"{format_bytes(measured['tensor_bytes'])} ({100 * measured['error']:+.1f}%)")  # fmt: skip
        devices.add_row(*row)

    cands = Table(title="Every candidate (per device)")
    right = ("total", "comm/step", "tokens/s", "scaling")
    for col in ("method", "distribution", "ckpt", "offload", "total", "comm/step", "tokens/s",
                "scaling", "fits"):  # fmt: skip
        cands.add_column(col, justify="right" if col in right else "left")
    limit = plan.hardware.budget(SAFETY_MARGIN)
    for c in j["candidates"]:
        if not c["supported"]:
            fits = "[bright_black]n/a[/]"
        else:
            fits = "[green]yes[/]" if c["fits"] else "[red]no[/]"
        style = "bold" if _is_chosen(c, j) else ""
        total = c["per_device_bytes"]["total"]
        cands.add_row(
            c["method"],
            c["distribution"],
            "on" if c["activation_checkpointing"] else "off",
            offload_label(c) or "-",
            f"{format_bytes(total)}" + (" ✗" if total > limit else ""),
            format_bytes(c["comm_bytes_per_step"]),
            *speed_cells(c.get("predicted")),
            fits,
            style=style,
        )
    reasons = Text("\n".join(f"• {r}" for r in j["reasons"]))
    if not plan.fits and plan.fits_when_idle:
        head += "\n[yellow]fits when the other processes on the cards are gone[/]"
    blocks: list[RenderableType] = [
        Panel(head, title="plan", expand=False),
        devices,
        *([held] if (held := held_text(plan.hardware)) else []),
        legend(per),
        *([offload_line(j)] if j.get("offload_cost") else []),
        *([host_line(j["host"])] if j.get("host") else []),
        cands,
        *([speed] if (speed := speed_text(plan)) is not None else []),
        Panel(reasons, title="why", expand=False),
    ]
    if plan.advice:  # what would make it fit (the speed advice is in the speed block)
        blocks.append(
            Panel(
                Text("\n".join(f"• {a}" for a in plan.advice)),
                title="what would make it fit",
                border_style="yellow",
                expand=False,
            )
        )
    if j.get("micro_batch_finder"):
        f = j["micro_batch_finder"]
        blocks.append(Text(f"micro-batch finder: {f['micro_batch']} × accumulation "
                           f"{f['grad_accum']} = effective batch {f['effective_batch']}"
                           + ("" if f["exact"] else f" (asked {f['requested_effective_batch']})")))  # fmt: skip
    if plan.seq_len_finder is not None:
        blocks.append(seq_len_text(plan.seq_len_finder))
    if (line := expected_text(expected)) is not None:
        blocks.append(line)
    if samples:
        blocks.append(Text(samples_text(samples)))
    blocks.append(Text(_provenance(j), style="dim"))
    return Group(*blocks)


def seq_len_text(finder: SeqLenFinder) -> Text:
    """`plan --find-seq-len`'s lines: the longest data.seq_len, then one line per candidate."""
    out = Text()
    out.append(f"sequence-length finder: {finder.max_seq_len:,} tokens", style="bold")
    out.append(f" at micro-batch {finder.micro_batch} (the plan is for {finder.planned_seq_len:,})")
    for line in finder.candidate_lines():
        out.append(f"\n  {line}")
    return out


def held_text(hw: PlanHardware) -> Text | None:
    """One line per local card with memory others hold: how much, by whom, the budget left
    (None when no card has any listed process and none is cut)."""
    limited = hw.limited(SAFETY_MARGIN)
    lines = [i for i, d in enumerate(hw.devices) if d.processes or i in limited]
    if not lines:
        return None
    out = Text()
    for n, i in enumerate(lines):
        d = hw.devices[i]
        name = f"GPU {hw.indices[i]}" if i < len(hw.indices) else d.name
        out.append("\n" if n else "").append(f"{name}: ", style="bold")
        out.append(f"{format_bytes(d.held_bytes)} held by ", style="yellow")
        out.append(holders(d))
        if i in limited:
            out.append(f" · budget {format_bytes(d.budget(SAFETY_MARGIN))}", style="bright_black")
    return out


def _is_chosen(c: dict, j: dict) -> bool:
    """Whether candidate ``c`` of the `plan --json` document ``j`` is its chosen option."""
    keys = ("method", "distribution", "offload", "offload_activations")
    return all(c.get(k) == j.get(k) for k in keys)


def offload_label(c: dict) -> str:
    """A candidate's offload in a word: "params", "optimizer", "acts", "params+acts" ("" none)."""
    parts = [c["offload"]] if c.get("offload", "none") != "none" else []
    return "+".join(parts + (["acts"] if c.get("offload_activations") else []))


def offload_line(j: dict) -> Text:
    """One line under the chosen budget: what is offloaded, the host RAM it pins, the PCIe
    traffic per step and the expected slowdown."""
    c = j["offload_cost"]
    out = Text("offload ", style="bold")
    out.append(offload_words(j["offload"], j["offload_activations"]) + ": ")
    if not c["pcie_bytes_per_step"] and not c["host_bytes_per_device"]:
        return out.append(f"nothing moves ({c['link']})", style="dim")
    out.append(f"{format_bytes(c['host_bytes_per_device'])} pinned host RAM per device · ")
    out.append(f"{format_bytes(c['pcie_bytes_per_step'])} over PCIe per step", style="bold")
    out.append(f" ({c['link']}{', assumed' if c['assumed'] else ''}) "
               f"≈ +{seconds(c['pcie_seconds_per_step'])} s per step")  # fmt: skip
    if c["slowdown"] is None:
        return out.append(" (card's compute peak not known: no slowdown estimate)", style="dim")
    return out.append(f" (~{c['slowdown']:.2f}× slower at {ASSUMED_MFU:.0%} MFU)", style="yellow")


def host_line(host: dict) -> Text:
    """One line: the machine's host RAM at its peak (loading, saving or merging), rank 0's part,
    and what is available."""
    phase = {"load": "loading", "checkpoint": "saving", "merge": "merging",
             "train": "training (offload, pinned)"}  # fmt: skip
    out = Text("host RAM ")
    out.append(format_bytes(host["total_bytes"]), style="bold")
    out.append(f" {phase.get(host['peak_phase'], host['peak_phase'])} "
               f"(rank 0 {format_bytes(host['per_process_bytes'])}) / ")  # fmt: skip
    if host["available_bytes"] is None:
        return out.append("not checked (what-if cards)", style="dim")
    out.append(f"{format_bytes(host['available_bytes'])} available ")
    if host["fits"]:
        return out.append("fits", style="green")
    return out.append("does NOT fit", style="bold red")


def _provenance(j: dict) -> str:
    """Which numbers are measured on this hardware and which are estimated or assumed."""
    cal = j.get("calibration") or {}
    out = "Overhead: " + "; ".join(j["assumptions"]) + "."
    if not cal.get("fingerprint"):
        return out + " Tensor components are estimates (what-if hardware: nothing measured)."
    if cal.get("measured"):
        return out + f" Tensor peak measured on {cal['fingerprint']}; components are estimates."
    return (out + f" Tensor components are estimates; `homelab-dp measure` measures them on "
            f"{cal['fingerprint']}.")  # fmt: skip


# ---------------------------------------------------------------------- the TUI's plan pane
def _capacities(planned: Planned) -> list[tuple[str, int]]:
    """Devices grouped by capacity, in order: ("2× 24.0 GiB", bytes)."""
    groups: dict[int, int] = {}
    for d in planned.hardware.devices:
        groups[d.memory_bytes] = groups.get(d.memory_bytes, 0) + 1
    return [
        (f"{n}× {format_bytes(cap)}" if n > 1 else format_bytes(cap), cap)
        for cap, n in groups.items()
    ]


def active_words(model: dict[str, Any]) -> str:
    """ ", 3.3B active" for a MoE model (active parameters below the total); "" otherwise."""
    active = model.get("active_params")
    if active is None or active >= model["params"]:
        return ""
    return f", {count(active)} active"


def decision_text(planned: Planned) -> Text:
    """Fits or not, the method and distribution, model size, batch and learning rate."""
    j = planned.plan.to_json()
    t, lr = j["training"], j["lr"]
    out = Text()
    if planned.plan.fits:
        out.append(" FITS ", style="bold black on green")
    else:
        out.append(" DOES NOT FIT ", style="bold white on red")
    ck = " + act. ckpt" if t["activation_checkpointing"] else ""
    out.append(f" {PLAIN[j['method']]} · {j['distribution']}{ck}\n", style="bold")
    out.append(f"{PLAIN[j['distribution']]}\n", style="bright_black")
    devices = ", ".join(label for label, _ in _capacities(planned))
    out.append(
        f"{count(j['model']['params'])} params{active_words(j['model'])} "
        f"({count(j['model']['trainable_params'])} trainable) · {t['dtype']} · "
        f"seq_len {t['seq_len']}\n"
        f"{planned.hardware.kind}: {devices} ({planned.hardware.source})\n"
    )
    held = held_text(planned.hardware)
    if held is not None:
        out.append_text(held).append("\n")
    if not planned.plan.fits and planned.plan.fits_when_idle:
        out.append("fits when the other processes on the cards are gone\n", style="yellow")
    out.append("effective batch ")
    out.append(str(t["effective_batch"]), style="bold")
    out.append(f" = micro {t['micro_batch']} × {t['world_size']} dev × accum {t['grad_accum']}\n")
    out.append("lr ")
    out.append(f"{lr['applied']:.3g}", style="bold")
    out.append(
        f" (preset {lr['preset']:.3g} at batch {lr['reference_batch']}, scaling {lr['rule']};"
    )
    out.append(f" linear {lr['linear']:.3g}, sqrt {lr['sqrt']:.3g})\n")
    out.append(f"gradient sync {format_bytes(j['comm_bytes_per_step'])} per step per device\n")
    if (cost := j.get("offload_cost")) and cost["pcie_bytes_per_step"]:
        out.append(f"offload {offload_label(j)}: ", style="bold")
        out.append(f"{format_bytes(cost['pcie_bytes_per_step'])} over PCIe per step ≈ "
                   f"+{seconds(cost['pcie_seconds_per_step'])} s\n")  # fmt: skip
    return out


def candidates_block(planned: Planned) -> Group:
    """Every supported candidate with a stacked memory bar per distinct device size."""
    j = planned.plan.to_json()
    rows: list[RenderableType] = [Text("Memory per device, every candidate", style="bold")]
    skipped = 0
    for c in j["candidates"]:
        if not c["supported"]:
            skipped += 1
            continue
        chosen = _is_chosen(c, j)
        per = c["per_device_bytes"]
        head = Text("▶ " if chosen else "  ", style="bold cyan")
        name = f"{c['method']} · {c['distribution']}" + (
            " · ckpt" if c["activation_checkpointing"] else ""
        )
        if off := offload_label(c):
            name += f" · {off}"
        head.append(f"{name:<24}", style="bold" if chosen else "")
        head.append(f"{format_bytes(per['total']):>9} ")
        head.append("fits" if c["fits"] else "too big", style="green" if c["fits"] else "red")
        rows.append(head)
        for label, cap in _capacities(planned):
            line = Text(f"  {label:>11} ", style="bright_black")
            line.append_text(memory_bar(per, cap, mark_over=False))
            rows.append(line)
    if skipped:
        rows.append(Text(f"  ({skipped} combinations do not apply here)", style="bright_black"))
    rows.append(legend(j["per_device_bytes"]))
    return Group(*rows)


def reasons_block(planned: Planned) -> Text:
    """Why this choice, and what would make it fit."""
    j = planned.plan.to_json()
    out = Text("Why\n", style="bold")
    for reason in j["reasons"]:
        out.append(f"• {reason}\n")
    if planned.plan.advice:
        out.append("What would make it fit\n", style="bold yellow")
        for advice in planned.plan.advice:
            out.append(f"• {advice}\n")
    out.append("Assumed, not measured: " + "; ".join(j["assumptions"]), style="bright_black")
    return out


def samples_text(samples: dict[str, Any]) -> str:
    """One line on the samples a run answers while it trains (`plan`'s ``samples`` block)."""
    rounds = f"{samples['rounds']} × " if samples.get("rounds") is not None else ""
    secs = samples.get("seconds")
    cost = f", about {duration(secs)} at the recorded tokens/s" if secs is not None else ""
    return (f"samples: {rounds}{samples['prompts']} prompt(s), up to {samples['max_tokens']} "
            f"tokens each{cost}")  # fmt: skip


def render_planned(planned: Planned) -> Group:
    """The whole plan pane (with the expected line when the preset has recorded runs)."""
    from homelab_dp.runs.preset_results import expected_runs

    parts: list[RenderableType] = [decision_text(planned)]
    expected = expected_runs(planned)
    if (line := expected_text(expected)) is not None:
        parts.append(line)
    if samples := planned_samples(planned, expected):
        parts.append(Text(samples_text(samples)))
    if (speed := speed_text(planned.plan)) is not None:
        parts.append(speed)
    if planned.plan.seq_len_finder is not None:
        parts.append(seq_len_text(planned.plan.seq_len_finder))
    return Group(*parts, candidates_block(planned), Text(), reasons_block(planned))


def speed_cells(predicted: dict[str, Any] | None) -> tuple[str, str]:
    """A candidate's predicted tokens/s and scaling (× of one device), or dashes."""
    if not predicted:
        return "-", "-"
    tps = predicted["tokens_per_s"]
    return f"{tps:,.0f}", f"{predicted['speedup_vs_one_device']:.2f}×"


def _flops(x: float | None) -> str:
    return "?" if not x else f"{x / 1e12:.1f} TFLOP/s" if x >= 1e12 else f"{x / 1e9:.1f} GFLOP/s"


def speed_text(plan: Plan) -> Text | None:
    """The time model's prediction for the chosen option, what it assumed (and where each
    figure came from), and the speed advice; None when nothing was predicted."""
    pred = plan.chosen.predicted
    if pred is None:
        return None
    out = Text("Speed (predicted) ", style="bold")
    n = plan.world_size
    out.append(
        f"step {seconds(pred.step_seconds)} s: compute {seconds(pred.compute_seconds)} s"
        + (f", communication {seconds(pred.comm_seconds)} s "
           f"({seconds(pred.exposed_comm_seconds)} s exposed)" if n > 1 else "")
        + (f", offload {seconds(pred.offload_seconds)} s" if pred.offload_seconds else "")
        + f" · {pred.tokens_per_s:,.0f} tokens/s"
    )  # fmt: skip
    if n > 1:
        out.append(f" · {pred.speedup_vs_one_device:.2f}× one device "
                   f"({pred.scaling_efficiency:.0%}) · {pred.bottleneck}-bound")  # fmt: skip
    a = pred.assumptions
    parts = []
    if (peak := a.get("peak_flops") or {}).get("value"):
        whose = peak["source"] if peak.get("known", True) else "card unknown: an RTX 3090's"
        parts.append(f"peak {_flops(peak['value'])} ({whose})")
    if a.get("achieved_factor", {}).get("value"):
        f = a["achieved_factor"]
        parts.append(f"achieved {f['value']:.0%} ({f['source']})")
    elif a.get("achieved_flops_per_s"):
        f = a["achieved_flops_per_s"]
        threads = a.get("threads_per_process")
        parts.append(f"achieved {_flops(f['value'])} per process ({threads} thread(s); "
                     f"{f['source']})")  # fmt: skip
    if n > 1 and a.get("link"):
        parts.append(f"link {a['link']['words']} ({a['link']['source']})")
    out.append("\nassumed: " + " · ".join(parts), style="bright_black")
    for line in plan.speed_advice:
        out.append(f"\n• {line}")
    return out


def data_ranks(t: dict[str, Any]) -> str:
    """The head line's devices: the data ranks, those a split sequence spans said apart."""
    n, sp = int(t["world_size"]), int(t.get("sequence_parallel") or 1)
    return f"{n} device(s)" if sp <= 1 else f"{n // sp} data rank(s) of {sp} device(s)"


def split_words(t: dict[str, Any]) -> str:
    """ " split over N" after seq_len when a sequence spans N devices."""
    sp = int(t.get("sequence_parallel") or 1)
    return f" split over {sp}" if sp > 1 else ""
