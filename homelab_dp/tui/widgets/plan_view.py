"""The plan as the TUI shows it: decision, batch and lr, a memory bar per device and candidate."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.text import Text

from homelab_dp.core.hardware import format_bytes
from homelab_dp.core.plan_reasons import PLAIN, count
from homelab_dp.render.plan import legend, memory_bar
from homelab_dp.run.planning import Planned


def _capacities(planned: Planned) -> list[tuple[str, int]]:
    """Devices grouped by capacity, in order: ("2× 24.0 GiB", bytes)."""
    groups: dict[int, int] = {}
    for d in planned.hardware.devices:
        groups[d.memory_bytes] = groups.get(d.memory_bytes, 0) + 1
    return [
        (f"{n}× {format_bytes(cap)}" if n > 1 else format_bytes(cap), cap)
        for cap, n in groups.items()
    ]


def _bar(per_device: dict[str, int], capacity: int) -> Text:
    """The CLI's stacked bar without its "◀ over" tail (it would wrap; the head says it)."""
    bar = memory_bar(per_device, capacity)
    tail = " ◀ over"
    return bar[: len(bar) - len(tail)] if bar.plain.endswith(tail) else bar


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
        f"{count(j['model']['params'])} params ({count(j['model']['trainable_params'])} "
        f"trainable) · {t['dtype']} · seq_len {t['seq_len']}\n"
        f"{planned.hardware.kind}: {devices} ({planned.hardware.source})\n"
    )
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
        chosen = (c["method"], c["distribution"]) == (j["method"], j["distribution"])
        per = c["per_device_bytes"]
        head = Text("▶ " if chosen else "  ", style="bold cyan")
        name = f"{c['method']} · {c['distribution']}" + (
            " · ckpt" if c["activation_checkpointing"] else ""
        )
        head.append(f"{name:<24}", style="bold" if chosen else "")
        head.append(f"{format_bytes(per['total']):>9} ")
        head.append("fits" if c["fits"] else "too big", style="green" if c["fits"] else "red")
        rows.append(head)
        for label, cap in _capacities(planned):
            line = Text(f"  {label:>11} ", style="bright_black")
            line.append_text(_bar(per, cap))
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
    if j["advice"]:
        out.append("What would make it fit\n", style="bold yellow")
        for advice in j["advice"]:
            out.append(f"• {advice}\n")
    out.append("Assumed, not measured: " + "; ".join(j["assumptions"]), style="bright_black")
    return out


def render_planned(planned: Planned) -> Group:
    """The whole plan pane."""
    return Group(decision_text(planned), candidates_block(planned), Text(), reasons_block(planned))
