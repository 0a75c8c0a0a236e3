"""The probe as text: the CLI's tables, and the TUI's cards, links and host (Hardware screen)."""

from __future__ import annotations

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from homelab_dp.byte_units import format_bytes
from homelab_dp.probe.hardware import (
    BF16_MIN_CAPABILITY,
    GpuInfo,
    HardwareReport,
    HostInfo,
    format_capability,
)
from homelab_dp.render.text import gauge, load_style, na

CARD_BAR = 12

LINK_MEANING = {
    "nvlink": "fast: gradient sync and sharding cost little",
    "p2p": "PCIe peer-to-peer: cards talk directly over PCIe",
    "pcie": "through host memory: sharding and large syncs are slow",
    "unknown": "not reported by the driver",
}
"""What each kind of link between two cards means for training."""


def link_kind(kind: str, nvlink_links: int | None) -> str:
    """``NVLink ×4``, or the kind as the probe names it."""
    return f"NVLink ×{nvlink_links}" if kind == "nvlink" else kind


def pcie_link(g: GpuInfo) -> str:
    """The card's current PCIe link: ``gen4 x16``, or ``n/a``."""
    return f"gen{g.pcie_gen} x{g.pcie_width}" if g.pcie_gen and g.pcie_width else "n/a"


def host_facts(host: HostInfo) -> tuple[str, str]:
    """(cores, RAM) of the host: ``16 logical cores (8 physical)``, ``62.7 GiB RAM (…)``."""
    cores = f"{host.logical_cores} logical cores"
    if host.physical_cores:
        cores += f" ({host.physical_cores} physical)"
    ram = f"{format_bytes(host.ram_total)} RAM"
    if host.ram_available:
        ram += f" ({format_bytes(host.ram_available)} available)"
    return cores, ram


# ---------------------------------------------------------------------- the CLI (`probe`)
def render_probe(report: HardwareReport) -> RenderableType:
    """Cards, links and host as tables."""
    parts: list[RenderableType] = []
    if report.gpus:
        table = Table(title=f"GPUs (driver {na(report.driver_version)})", expand=False)
        for col in (
            "#",
            "name",
            "memory used/total",
            "compute",
            "util",
            "temp",
            "power/limit",
            "PCIe",
        ):
            table.add_column(col)
        for g in report.gpus:
            used = format_bytes(g.memory_used) if g.memory_used is not None else "n/a"
            power = (
                f"{g.power_w:.0f}/{g.power_limit_w:.0f} W"
                if g.power_w is not None and g.power_limit_w is not None
                else na(g.power_w, " W")
            )
            table.add_row(
                str(g.index),
                g.name,
                f"{used} / {format_bytes(g.memory_total)}",
                compute_text(g),
                na(g.utilization_pct, "%"),
                na(g.temperature_c, "°C"),
                power,
                pcie_link(g),
            )
        parts.append(table)
        mig = mig_table(report)
        if mig is not None:
            parts.append(mig)
        held = processes_table(report)
        if held is not None:
            parts.append(held)
    if report.links:
        links = Table(title="Between cards")
        for col in ("pair", "link", "what it means"):
            links.add_column(col)
        for link in report.links:
            kind = link_kind(link.kind, link.nvlink_links)
            links.add_row(f"{link.a}↔{link.b}", kind, LINK_MEANING[link.kind])
        parts.append(links)
    cores, ram = host_facts(report.host)
    parts.append(Text(f"Host: {report.host.cpu_model}, {cores}, {ram}"))
    if report.notice:
        parts.append(Text(f"note: {report.notice}", style="yellow"))
    return Group(*parts)


def mig_text(g: GpuInfo) -> str | None:
    """The card's MIG mode in words ("MIG on, 2 slices", "MIG off, on after a reset"); None
    for a card without MIG."""
    if g.mig is None:
        return None
    n = len(g.mig.slices)
    if g.mig.enabled:
        said = f"MIG on, {n} slice{'s' if n != 1 else ''}"
        return said if g.mig.pending else said + ", off after a reset"
    return "MIG off, on after a reset" if g.mig.pending else "MIG off"


def mig_table(report: HardwareReport) -> Table | None:
    """The MIG slices of each card with MIG on: what CUDA sees, one per process (a plan uses
    one, never the whole card); None when no card has MIG on."""
    cards = [g for g in report.gpus if g.mig is not None and g.mig.enabled]
    if not cards:
        return None
    table = Table(title="MIG on: CUDA sees these slices, one per process", expand=False)
    for col in ("#", "slice", "profile", "memory used/total", "UUID"):
        table.add_column(col, no_wrap=col == "UUID")
    for g in cards:
        if not g.mig or not g.mig.slices:
            table.add_row(str(g.index), "none", "", "", "no MIG instance: CUDA cannot use it")
        for s in g.mig.slices if g.mig else ():
            used = format_bytes(s.memory_used) if s.memory_used is not None else "n/a"
            memory = f"{used} / {format_bytes(s.memory_bytes)}"
            table.add_row(str(g.index), str(s.index), s.profile, memory, s.uuid or "n/a")
    return table


def processes_table(report: HardwareReport) -> Table | None:
    """The processes holding memory on each card (NVML's compute and graphics lists); None
    when there are none to show."""
    rows = [(g, p) for g in report.gpus for p in g.processes or ()]
    if not rows:
        return None
    table = Table(title="Processes on the cards", expand=False)
    for col in ("#", "pid", "name", "type", "memory"):
        table.add_column(col, justify="right" if col in ("pid", "memory") else "left")
    for g, p in rows:
        used = format_bytes(p.used_bytes) if p.used_bytes is not None else "n/a"
        table.add_row(str(g.index), str(p.pid), p.name or "?", p.kind, used)
    return table


def compute_text(g: GpuInfo) -> str:
    """Compute capability and the precision "auto" trains in on it ("8.6 bf16", "7.5 fp16")."""
    cc = g.compute_capability
    if cc is None:
        return "n/a"
    return f"{format_capability(cc)} {'bf16' if tuple(cc) >= BF16_MIN_CAPABILITY else 'fp16'}"


# ---------------------------------------------------------------------- the TUI (Hardware)
def gpu_title(g: GpuInfo) -> str:
    """The card's border title: index and short name."""
    return f"GPU {g.index} · {g.name.removeprefix('NVIDIA ').removeprefix('GeForce ')}"


def gpu_card(g: GpuInfo) -> Text:
    """Memory, utilisation, temperature, power and PCIe link of one card."""
    out = Text()
    frac = g.memory_used / g.memory_total if g.memory_used is not None else None
    out.append("memory ").append_text(gauge(frac, CARD_BAR, load_style(frac)))
    used = format_bytes(g.memory_used) if g.memory_used is not None else "n/a"
    out.append(f" {used}\n       of {format_bytes(g.memory_total)}\n")
    util = g.utilization_pct / 100 if g.utilization_pct is not None else None
    out.append("util   ").append_text(gauge(util, CARD_BAR, "cyan"))
    out.append(f" {na(g.utilization_pct, '%')}\n")
    out.append(f"temp   {na(g.temperature_c, '°C')}   power ")
    if g.power_w is not None and g.power_limit_w:
        out.append(f"{g.power_w:.0f} / {g.power_limit_w:.0f} W\n")
    else:
        out.append(f"{na(None if g.power_w is None else round(g.power_w), ' W')}\n")
    mig = mig_text(g)
    if mig:
        out.append(
            f"MIG    {mig.removeprefix('MIG ')}\n", style="yellow" if mig != "MIG off" else ""
        )
    out.append(f"PCIe   {pcie_link(g)}")
    maximum = (g.pcie_gen_max, g.pcie_width_max)
    if g.pcie_gen and g.pcie_width and maximum not in ((None, None), (g.pcie_gen, g.pcie_width)):
        out.append(f" (card max gen{g.pcie_gen_max} x{g.pcie_width_max})", style="yellow")
    return out


def topology_meaning(report: HardwareReport) -> str:
    """What the links between the cards mean for data-parallel training."""
    if len(report.gpus) < 2:
        return "One card: no traffic between cards; DDP with world size 1 is a plain run."
    kinds = {link.kind for link in report.links}
    if kinds == {"nvlink"}:
        return (
            "Every pair is on NVLink: the all-reduce of DDP and the all-gathers of FSDP are "
            "cheap, so sharding (ZeRO / FSDP) to fit a bigger model costs little speed."
        )
    if "pcie" in kinds or "unknown" in kinds or not kinds:
        return (
            "Some cards reach each other only through host memory: gradient sync is slow. "
            "Prefer DDP or LoRA (small gradients) with more gradient accumulation (fewer syncs "
            "per sample); shard with FSDP only when nothing else fits."
        )
    return (
        "PCIe peer-to-peer between the cards: DDP runs well; FSDP moves about 1.5x more data "
        "per step and costs some throughput."
    )


def topology_text(report: HardwareReport) -> Text:
    """Each pair of cards with its link, then what it means."""
    out = Text()
    for link in report.links:
        style = {"nvlink": "green", "p2p": "cyan", "pcie": "yellow"}.get(link.kind, "")
        out.append(f"GPU {link.a} ↔ GPU {link.b}  ")
        out.append(link_kind(link.kind, link.nvlink_links), style=f"bold {style}")
        if link.topology:
            out.append(f" · {link.topology}")
        if link.p2p is not None:
            out.append(f" · peer-to-peer {'yes' if link.p2p else 'no'}")
        out.append(f"\n  {LINK_MEANING[link.kind]}\n", style="bright_black")
    out.append(topology_meaning(report))
    return out


def host_text(host: HostInfo) -> Text:
    """The CPU host: its model, then cores and RAM."""
    cores, ram = host_facts(host)
    return Text(f"{host.cpu_model}\n{cores}, {ram}")


def summary_text(report: HardwareReport) -> Text:
    """One line: how many cards, the driver and where the facts came from."""
    if not report.gpus:
        return Text("No GPU: plans and runs use the CPU host.", style="bold yellow")
    driver = f"driver {report.driver_version}" if report.driver_version else "driver n/a"
    if report.cuda_driver_version:
        driver += f", CUDA {report.cuda_driver_version}"
    source = ""
    if report.source and report.source.startswith("recording "):
        source = " · recorded: " + report.source.split("/")[-1]  # file name: same on any machine
    total = sum(g.memory_total for g in report.gpus)
    n = len(report.gpus)
    return Text(f"{n} GPU{'s' if n > 1 else ''}, {format_bytes(total)} in all · {driver}{source}")
