"""Rich renderings of probes and plans for people (the CLI's non-JSON output)."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from homelab_dp.core.hardware import HardwareReport, format_bytes
from homelab_dp.core.memory import COMPONENTS
from homelab_dp.core.plan_reasons import PLAIN, count
from homelab_dp.core.planner import SAFETY_MARGIN, Plan

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


def _na(value: object, unit: str = "") -> str:
    return "n/a" if value is None else f"{value}{unit}"


def render_probe(report: HardwareReport) -> RenderableType:
    """Cards, links and host as tables."""
    parts: list[RenderableType] = []
    if report.gpus:
        table = Table(title=f"GPUs (driver {_na(report.driver_version)})", expand=False)
        for col in ("#", "name", "memory used/total", "util", "temp", "power/limit", "PCIe"):
            table.add_column(col)
        for g in report.gpus:
            used = format_bytes(g.memory_used) if g.memory_used is not None else "n/a"
            power = (
                f"{g.power_w:.0f}/{g.power_limit_w:.0f} W"
                if g.power_w is not None and g.power_limit_w is not None
                else _na(g.power_w, " W")
            )
            pcie = f"gen{g.pcie_gen} x{g.pcie_width}" if g.pcie_gen and g.pcie_width else "n/a"
            table.add_row(
                str(g.index),
                g.name,
                f"{used} / {format_bytes(g.memory_total)}",
                _na(g.utilization_pct, "%"),
                _na(g.temperature_c, "°C"),
                power,
                pcie,
            )
        parts.append(table)
    if report.links:
        links = Table(title="Between cards")
        for col in ("pair", "link", "what it means"):
            links.add_column(col)
        meaning = {
            "nvlink": "fast: gradient sync and sharding cost little",
            "p2p": "PCIe peer-to-peer: cards talk directly over PCIe",
            "pcie": "through host memory: sharding and large syncs are slow",
            "unknown": "not reported by the driver",
        }
        for link in report.links:
            kind = f"NVLink ×{link.nvlink_links}" if link.kind == "nvlink" else link.kind
            links.add_row(f"{link.a}↔{link.b}", kind, meaning[link.kind])
        parts.append(links)
    h = report.host
    parts.append(
        Text(
            f"Host: {h.cpu_model}, {h.logical_cores} logical cores"
            + (f" ({h.physical_cores} physical)" if h.physical_cores else "")
            + f", {format_bytes(h.ram_total)} RAM"
            + (f" ({format_bytes(h.ram_available)} available)" if h.ram_available else "")
        )
    )
    if report.notice:
        parts.append(Text(f"note: {report.notice}", style="yellow"))
    return Group(*parts)


def memory_bar(per_device: dict[str, int], capacity: int) -> Text:
    """A stacked bar of the memory components against one device's capacity."""
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
    elif total > capacity:
        bar.append(" ◀ over", style="bold red")
    return bar


def legend(per_device: dict[str, int]) -> Text:
    """The bar's colours with each component's size."""
    out = Text()
    for comp in (*COMPONENTS, "overhead"):
        out.append("█ ", style=COLOURS[comp]).append(f"{comp} {format_bytes(per_device[comp])}  ")
    out.append("░ free", style="bright_black")
    return out


def render_plan(plan: Plan) -> RenderableType:
    """The decision, the memory of every device, every candidate, reasons and advice."""
    j = plan.to_json()
    t = j["training"]
    ok = "[bold green]FITS[/]" if plan.fits else "[bold red]DOES NOT FIT[/]"
    ck = ", activation checkpointing" if t["activation_checkpointing"] else ""
    head = (
        f"{ok}  {PLAIN[j['method']]} · {PLAIN[j['distribution']]}{ck}\n"
        f"model {count(j['model']['params'])} params "
        f"({count(j['model']['trainable_params'])} trainable) · "
        f"micro-batch {t['micro_batch']} × {t['world_size']} device(s) × accumulation "
        f"{t['grad_accum']} = effective batch {t['effective_batch']} · seq_len {t['seq_len']} · "
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
    for d in plan.hardware.devices:
        row = [d.name, memory_bar(per, d.memory_bytes),
               f"{format_bytes(per['total'])} / {format_bytes(d.memory_bytes)}"]  # fmt: skip
        if measured:
            row.append(f"{format_bytes(measured['estimate_tensor_bytes'])} / "
                       f"{format_bytes(measured['tensor_bytes'])} ({100 * measured['error']:+.1f}%)")  # fmt: skip
        devices.add_row(*row)

    cands = Table(title="Every candidate (per device)")
    for col in ("method", "distribution", "ckpt", "total", "comm/step", "fits"):
        cands.add_column(col, justify="right" if col in ("total", "comm/step") else "left")
    limit = SAFETY_MARGIN * plan.hardware.min_memory
    for c in j["candidates"]:
        if not c["supported"]:
            fits = "[bright_black]n/a[/]"
        else:
            fits = "[green]yes[/]" if c["fits"] else "[red]no[/]"
        chosen = c["method"] == j["method"] and c["distribution"] == j["distribution"]
        style = "bold" if chosen else ""
        total = c["per_device_bytes"]["total"]
        cands.add_row(
            c["method"],
            c["distribution"],
            "on" if c["activation_checkpointing"] else "off",
            f"{format_bytes(total)}" + (" ✗" if total > limit else ""),
            format_bytes(c["comm_bytes_per_step"]),
            fits,
            style=style,
        )
    reasons = Text("\n".join(f"• {r}" for r in j["reasons"]))
    blocks: list[RenderableType] = [
        Panel(head, title="plan", expand=False),
        devices,
        legend(per),
        cands,
        Panel(reasons, title="why", expand=False),
    ]
    if j["advice"]:
        blocks.append(
            Panel(
                Text("\n".join(f"• {a}" for a in j["advice"])),
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
    blocks.append(Text(_provenance(j), style="dim"))
    return Group(*blocks)


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
