"""Renderings of a followed run: progress, gradient accumulation, devices, stragglers."""

from __future__ import annotations

from rich.text import Text

from homelab_dp.core.hardware import format_bytes
from homelab_dp.core.run_view import DeviceView, RunView
from homelab_dp.tui.widgets.bars import gauge, memory_gauge

STATUS_STYLE = {
    "running": "bold green",
    "starting": "bold cyan",
    "stopping": "bold yellow",
    "completed": "bold green",
    "interrupted": "bold yellow",
    "stopped": "bold yellow",
    "failed": "bold red",
}


def duration(seconds: float | None) -> str:
    """``1h02m``, ``3m05s``, ``42s``; ``-`` when unknown."""
    if seconds is None:
        return "-"
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def head_text(view: RunView, width: int = 30) -> Text:
    """Run id and status, then step progress, ETA, loss with its trend, lr and energy."""
    out = Text()
    out.append(view.run_id, style="bold")
    out.append("  ")
    out.append(view.status, style=STATUS_STYLE.get(view.status, "bold"))
    if view.method:
        out.append(f"  {view.method} · {view.distribution} · world {view.world_size}")
    out.append("\n")
    frac = view.step / view.total_steps if view.total_steps else None
    out.append("step ").append_text(gauge(frac, width, "green"))
    out.append(f" {view.step}/{view.total_steps or '?'}")
    eta = "done" if view.status == "completed" else duration(view.eta_s)
    out.append(f"  ETA {eta}  elapsed {duration(view.elapsed_s)}\n")
    out.append("loss ")
    out.append("-" if view.loss is None else f"{view.loss:.4f}", style="bold")
    trend = view.loss_trend
    if trend is not None:
        arrow, style = ("↓", "green") if trend < 0 else ("↑", "red")
        out.append(f" {arrow}{abs(trend):.3f}", style=style)
    out.append(f"  lr {'-' if view.lr is None else f'{view.lr:.2e}'}")
    out.append(f"  energy {view.energy_wh:.1f} Wh")
    if view.cost is not None:
        out.append(f" ≈ {view.cost:.2f} {view.currency}".rstrip())
    if view.tokens_per_wh:
        out.append(f"  {view.tokens_per_wh:,.0f} tok/Wh")
    if view.error:
        out.append(f"\n{view.error}", style="bold red")
    return out


def accum_text(view: RunView, width: int = 16) -> Text:
    """Micro-step k of n in the current optimizer step, and the effective batch formula."""
    out = Text("accumulation ", style="bold")
    n = max(view.grad_accum, 1)
    for k in range(1, n + 1) if n <= width else ():
        out.append(
            "■" if k <= view.micro_step else "□", style="cyan" if k <= view.micro_step else ""
        )
    if n > width:
        out.append_text(gauge(view.micro_step / n, width, "cyan"))
    out.append(f" {view.micro_step}/{n}   effective batch ")
    eff = view.effective_batch or view.micro_batch * view.world_size * n
    out.append(str(eff), style="bold")
    out.append(f" = micro {view.micro_batch} × world {view.world_size} × accum {n}")
    return out


def _rank(key: str, keys: list[str]) -> int:
    """The rank a device sample belongs to: rankN is N; GPUs in index order map to ranks."""
    if key.startswith("rank") and key[4:].isdigit():
        return int(key[4:])
    return keys.index(key)


def device_text(dev: DeviceView, view: RunView, rank: int, width: int = 12) -> Text:
    """Two lines: utilisation, temperature, power and energy; memory against card and estimate."""
    cpu = dev.key.startswith("rank")
    util = dev.utilization_pct
    out = Text(f"{dev.key:<6}", style="bold")
    out.append("cpu  " if cpu else "util ")
    frac = None if util is None else min(util / 100, 1.0)
    out.append_text(gauge(frac, width, "cyan"))
    out.append(f" {'n/a' if util is None else f'{util:.0f}%':>5}")
    if dev.temperature_c is not None:
        hot = dev.temperature_c >= 80
        out.append(f"  {dev.temperature_c:.0f}°C", style="bold red" if hot else "")
    if dev.power_w is not None:
        out.append(f"  {dev.power_w:.0f} W")
    if not cpu or dev.energy_wh:
        out.append(f"  {dev.energy_wh:.2f} Wh")
    out.append("\n      mem  ")
    out.append_text(memory_gauge(dev.memory_used, dev.memory_total, view.estimate_bytes, width))
    used = "n/a" if dev.memory_used is None else format_bytes(dev.memory_used)
    total = "n/a" if dev.memory_total is None else format_bytes(dev.memory_total)
    out.append(f" {used}/{total}")
    if view.estimate_bytes:
        out.append(f" · est {format_bytes(view.estimate_bytes)}", style="bright_black")
    if 0 <= rank < len(view.peak_memory_bytes):
        out.append(f" · peak {format_bytes(view.peak_memory_bytes[rank])}", style="bright_black")
    return out


def devices_text(view: RunView) -> Text:
    """Every device of the run, or a note that no sample came yet."""
    if not view.devices:
        return Text("no device samples yet (the monitor writes one a second)", style="bright_black")
    keys = list(view.devices)
    parts = [device_text(view.devices[k], view, _rank(k, keys)) for k in keys]
    return Text("\n").join(parts)


def stragglers_text(view: RunView) -> Text:
    """The straggler warnings, one a line (empty when none)."""
    out = Text()
    for rank in sorted(view.stragglers):
        if out:
            out.append("\n")
        out.append(f"⚠ {view.stragglers[rank]}", style="bold yellow")
    return out
