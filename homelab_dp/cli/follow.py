"""Following a run from the CLI: a rich live panel on a terminal, plain lines elsewhere, or JSON.

When stdout is a terminal the panel redraws in place; under nohup, in a log file or a pipe it
prints one timestamped line per logged step instead; ``--json`` prints every event as a JSON
line. Ctrl-C only detaches: the run goes on.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any, TextIO

from homelab_dp.core.hardware import format_bytes
from homelab_dp.core.run_view import RunView
from homelab_dp.run.controller import RunController
from homelab_dp.rundir.state import ACTIVE, current_state
from homelab_dp.rundir.tail import file_size

POLL_S = 0.25
EXIT_BY_STATUS = {"completed": 0, "failed": 1, "interrupted": 130}


def _hms(seconds: float | None) -> str:
    if seconds is None:
        return "--:--:--"
    s = int(seconds)
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def _num(value: float | None, fmt: str = ",.0f") -> str:
    return "–" if value is None else format(value, fmt)


def step_line(v: RunView) -> str:
    """One line for a logged step (plain mode)."""
    trend = v.loss_trend
    arrow = "" if trend is None else (f" (↓{-trend:.3f})" if trend < 0 else f" (↑{trend:.3f})")
    loss = f"{v.loss:.4f}" if v.loss is not None else "–"
    return (
        f"step {v.step}/{v.total_steps} loss {loss}{arrow} lr {_num(v.lr, '.2e')} "
        f"tok/s {_num(v.tokens_per_s)} samples/s {_num(v.samples_per_s, ',.1f')} "
        f"eta {_hms(v.eta_s)} | batch {v.micro_batch}×{v.world_size}×{v.grad_accum}"
        f"={v.effective_batch}"
    )


def device_line(v: RunView) -> str:
    """One line with every device (plain mode)."""
    parts = []
    for key, d in sorted(v.devices.items()):
        mem = format_bytes(d.memory_used) if d.memory_used is not None else "–"
        bits = [f"{key} {_num(d.utilization_pct)}%", f"mem {mem}"]
        if d.temperature_c is not None:
            bits.append(f"{d.temperature_c:.0f}°C")
        if d.power_w is not None:
            bits.append(f"{d.power_w:.0f} W")
        parts.append(" ".join(bits))
    energy = f" | energy {v.energy_wh:.2f} Wh" if v.energy_wh else ""
    return " | ".join(parts) + energy


def render_live(v: RunView):
    """The rich panel for a terminal."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.progress_bar import ProgressBar
    from rich.table import Table

    head = Table.grid(padding=(0, 2))
    head.add_row(
        f"[bold]{v.run_id}[/]",
        f"status [bold]{v.status}[/]",
        f"{v.method} · {v.distribution}",
    )
    stats = Table.grid(padding=(0, 2))
    trend = v.loss_trend
    arrow = "" if trend is None else ("[green]↓[/]" if trend < 0 else "[red]↑[/]")
    loss = f"{v.loss:.4f}" if v.loss is not None else "–"
    stats.add_row(
        f"step {v.step}/{v.total_steps}",
        f"loss {loss} {arrow}",
        f"lr {_num(v.lr, '.2e')}",
        f"ETA {_hms(v.eta_s)}",
    )
    stats.add_row(
        f"tok/s {_num(v.tokens_per_s)}",
        f"samples/s {_num(v.samples_per_s, ',.1f')}",
        f"step {_num(v.step_time_s, '.2f')} s",
        f"tokens {v.tokens:,}",
    )
    progress = ProgressBar(total=max(v.total_steps, 1), completed=v.step, width=60)
    accum = (
        f"accumulation: micro-step {v.micro_step} of {v.grad_accum} · effective batch "
        f"{v.micro_batch} × {v.world_size} × {v.grad_accum} = {v.effective_batch}"
    )
    devices = Table(box=None, pad_edge=False)
    for col in ("device", "util", "memory", "vs estimate", "temp", "power", "energy"):
        devices.add_column(col)
    for key, d in sorted(v.devices.items()):
        mem = "–"
        if d.memory_used is not None:
            cap = f" / {format_bytes(d.memory_total)}" if d.memory_total else ""
            mem = f"{format_bytes(d.memory_used)}{cap}"
        est = f"{format_bytes(v.estimate_bytes)} est." if v.estimate_bytes else "–"
        devices.add_row(
            key,
            f"{_num(d.utilization_pct)}%",
            mem,
            est,
            f"{d.temperature_c:.0f}°C" if d.temperature_c is not None else "–",
            f"{d.power_w:.0f} W" if d.power_w is not None else "–",
            f"{d.energy_wh:.2f} Wh" if d.energy_wh else "–",
        )
    lines: list[Any] = [head, stats, progress, accum, devices]
    if v.energy_wh:
        cost = f" · {v.cost:.3f} {v.currency}" if v.cost is not None else ""
        per = f" · {v.tokens_per_wh:,.0f} tokens/Wh" if v.tokens_per_wh else ""
        lines.append(f"energy {v.energy_wh:.2f} Wh{per}{cost}")
    for warning in v.stragglers.values():
        lines.append(f"[yellow]straggler: {warning}[/]")
    if v.error:
        lines.append(f"[red]{v.error}[/]")
    return Panel(Group(*lines), title="homelab-dp", subtitle="Ctrl-C detaches; the run goes on")


def follow(
    controller: RunController,
    run_id: str,
    mode: str,
    out: TextIO = sys.stdout,
    history_until: int | None = None,
) -> int:
    """Follow ``run_id`` until it ends; ``mode`` is "live", "plain" or "json". Returns exit code.

    Events before byte ``history_until`` of events.jsonl (default: all there are now) are
    history: folded into the view without being printed, so only what happens from now on is.
    """
    run_dir = controller.run_dir(run_id)
    view = controller.new_view(run_dir)
    tail = controller.tail(run_id)
    until = file_size(run_dir / "events.jsonl") if history_until is None else history_until
    for event in tail.events.read(until):
        view.apply(event)
    if mode == "plain" and view.step:
        sys.stderr.write(f"attached at step {view.step}/{view.total_steps}\n")
    printer = _Printer(mode, out, view)
    try:
        with printer:
            while True:
                state = current_state(run_dir)
                for event in tail.read():
                    view.apply(event)
                    printer.event(event)
                if state.get("status") not in ACTIVE:
                    for event in tail.read():  # drain what the end wrote
                        view.apply(event)
                        printer.event(event)
                    view.apply_state(state)
                    printer.final(state)
                    # How the processes ended, whatever the events said ("unknown" fails).
                    return EXIT_BY_STATUS.get(state.get("status", view.status), 1)
                printer.tick()
                time.sleep(POLL_S)
    except KeyboardInterrupt:
        sys.stderr.write(
            f"\ndetached; the run goes on. Re-attach with: homelab-dp attach {run_dir.name}\n"
        )
        return 130


class _Printer:
    """Writes a followed run in one of the three modes."""

    def __init__(self, mode: str, out: TextIO, view: RunView) -> None:
        self.mode, self.out, self.view = mode, out, view
        self.live = None
        self._last_devices = 0.0

    def __enter__(self) -> _Printer:
        if self.mode == "live":
            from rich.live import Live

            self.live = Live(render_live(self.view), refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.update(render_live(self.view))
            self.live.__exit__(None, None, None)

    def _plain(self, text: str) -> None:
        self.out.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        self.out.flush()

    def event(self, e: dict[str, Any]) -> None:
        kind = e.get("type")
        if self.mode == "json":
            self.out.write(json.dumps(e) + "\n")
            self.out.flush()
        elif self.mode == "plain":
            if kind == "step":
                self._plain(step_line(self.view))
            elif kind == "devices" and time.time() - self._last_devices >= 10:
                self._last_devices = time.time()
                self._plain(device_line(self.view))
            elif kind == "start":
                self._plain(
                    f"started {self.view.run_id}: {self.view.method} · {self.view.distribution}, "
                    f"{self.view.world_size} process(es), {self.view.total_steps} steps"
                )
            elif kind == "checkpoint":
                self._plain(f"checkpoint at step {e.get('step')}: {e.get('path')}")
            elif kind in ("straggler", "warning", "retry"):
                detail = e.get("message") or e.get("reason")
                self._plain(f"{'retry' if kind == 'retry' else 'warning'}: {detail}")
            elif kind in ("error", "end", "state"):
                detail = e.get("message") or e.get("reason") or e.get("status")
                self._plain(f"{kind}: {detail}")

    def tick(self) -> None:
        if self.live is not None:
            self.live.update(render_live(self.view))

    def final(self, state: dict[str, Any]) -> None:
        if self.mode == "json":
            return
        text = f"run {self.view.run_id} {state.get('status')}: {state.get('reason') or ''}".strip()
        if self.view.final_path:
            text += f"\nresult: {self.view.final_path}"
        if self.mode == "plain":
            self._plain(text)
        else:
            self.tick()
            self.out.write(text + "\n")
