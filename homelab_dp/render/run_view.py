"""A followed run as text: the CLI's live panel and log lines, the TUI's Monitor panels.

Everything here reads a `RunView` (and, for the lines of a plain log, the event just folded
into it); the following itself — tailing the run's files until it ends — belongs to the front
ends (`homelab_dp.cli.follow`, `homelab_dp.app.follow`).
"""

from __future__ import annotations

from typing import Any

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from homelab_dp.byte_units import format_bytes
from homelab_dp.render.text import duration, gauge, memory_gauge, mfu_text, num
from homelab_dp.runs.folder.rollouts import Rollouts
from homelab_dp.runs.run_view import DeviceView, RunView

STATUS_STYLE = {
    "running": "bold green",
    "starting": "bold cyan",
    "queued": "bold magenta",
    "stopping": "bold yellow",
    "completed": "bold green",
    "interrupted": "bold yellow",
    "stopped": "bold yellow",
    "failed": "bold red",
}


# ---------------------------------------------------------------------- objective and speed
def objective_text(figures: dict[str, Any] | None) -> str | None:
    """A preference objective's figures in words (None: none, as SFT): "reward accuracy 0.875,
    margin 0.500 (chosen 0.250, rejected -0.250)" for DPO/KTO, "nll 1.2500, log odds 0.250"
    for ORPO — the keys of `RunView.objective_doc` and of step and eval events alike."""
    if not figures:
        return None
    parts = []
    if figures.get("reward") is not None:  # GRPO
        spread = figures.get("reward_std")
        parts.append(f"reward {figures['reward']:.3f}"
                     + (f" ± {spread:.3f}" if spread is not None else ""))  # fmt: skip
        if figures.get("completion_length") is not None:
            parts.append(f"completion {figures['completion_length']:.1f} tokens")
        if figures.get("clipped"):  # iterations > 1: the later passes' ratio
            parts.append(f"clipped {100 * figures['clipped']:.1f}%")
        if figures.get("kl") is not None:
            parts.append(f"KL {figures['kl']:.4f}")
        if figures.get("generation_s"):
            parts.append(f"generation {figures['generation_s']:.1f} s")
    if figures.get("reward_accuracy") is not None:
        parts.append(f"reward accuracy {figures['reward_accuracy']:.3f}")
    if figures.get("reward_margin") is not None:
        parts.append(f"margin {figures['reward_margin']:.3f}")
    chosen, rejected = figures.get("rewards_chosen"), figures.get("rewards_rejected")
    if chosen is not None and rejected is not None:
        rewards = f"(chosen {chosen:.3f}, rejected {rejected:.3f})"
        if parts:
            parts[-1] += f" {rewards}"
        else:  # KTO may give rewards without a pair's margin
            parts.append(f"rewards {rewards[1:-1]}")
    if figures.get("nll") is not None:
        parts.append(f"nll {figures['nll']:.4f}")
    if figures.get("log_odds_ratio") is not None:
        parts.append(f"log odds {figures['log_odds_ratio']:.3f}")
    return ", ".join(parts) or None


def scaling_text(scaling: dict[str, Any] | None, predicted: float | None = None) -> str | None:
    """ "scaling 1.82× of 2 (91%)" from ``status --json``'s ``scaling`` (None: one process or
    nothing measured yet); with the plan's speedup: "…, predicted 1.85×"."""
    if not scaling:
        return None
    text = f"scaling {scaling['speedup']:.2f}× of {scaling['world']} ({scaling['efficiency']:.0%})"
    return text + (f", predicted {predicted:.2f}×" if predicted is not None else "")


def comm_text(scaling: dict[str, Any] | None, predicted: float | None = None) -> str | None:
    """The measured communication share: "communication 20% of the step, 10% exposed" (the
    share nothing hid, when overlap hid some), over the median's steps; with the plan's exposed
    share: "…, 10% exposed (predicted 8%)"."""
    if not scaling:
        return None
    exposed = scaling["exposed_share"]
    share = scaling.get("comm_share")
    guess = f" (predicted {predicted:.0%})" if predicted is not None else ""
    if share is None:
        return f"{exposed:.0%} of the step not computing{guess}"
    hidden = f", {exposed:.0%} exposed" if exposed < share - 0.005 else ""
    return f"communication {share:.0%} of the step{hidden}{guess}"


def _against(measured: float | None, predicted: float | None, fmt: str, unit: str) -> str | None:
    if predicted is None:
        return None
    text = f"{format(predicted, fmt)}{unit} predicted"
    if measured is None:
        return f"{text}, not measured yet"
    off = f" ({measured / predicted - 1:+.0%})" if predicted > 0 else ""
    return f"{format(measured, fmt)}{unit} measured, {text}{off}"


def prediction_text(speed: dict[str, Any] | None) -> str | None:
    """Predicted against measured from ``status --json``'s ``speed`` (None: the plan predicted
    nothing): "step 2.00 s measured, 1.90 s predicted (+5%); tokens/s 1,000 measured, 1,200
    predicted (-17%)"."""
    if not speed:
        return None
    step = _against(
        speed.get("measured_step_seconds"), speed.get("predicted_step_seconds"), ".2f", " s"
    )
    tps = _against(speed.get("measured_tokens_per_s"), speed.get("predicted_tokens_per_s"),
                   ",.0f", "")  # fmt: skip
    parts = [f"step {step}" if step else None, f"tokens/s {tps}" if tps else None]
    return "; ".join(p for p in parts if p) or None


def _scaling_doc(v: RunView) -> dict[str, Any] | None:
    scaling = v.scaling
    return scaling.to_json() if scaling else None


def _predicted_speedup(v: RunView) -> float | None:
    speed = v.speed_doc()
    return speed.get("predicted_speedup") if speed else None


def _predicted_exposed(v: RunView) -> float | None:
    speed = v.speed_doc()
    return speed.get("predicted_exposed_share") if speed else None


# ---------------------------------------------------------------------- the CLI's plain log
def split_text(degree: int) -> str:
    """The start line's words for sequence parallelism ("" for whole sequences)."""
    if degree <= 1:
        return ""
    return f", every sequence split over {degree} ranks (all-to-all in comm)"


def step_line(v: RunView) -> str:
    """One line for a logged step (then, where the run has them, its objective's figures and
    the measured scaling)."""
    trend = v.loss_trend
    arrow = "" if trend is None else (f" (↓{-trend:.3f})" if trend < 0 else f" (↑{trend:.3f})")
    line = (
        f"step {v.step}/{v.total_steps} loss {num(v.loss, '.4f')}{arrow} lr {num(v.lr, '.2e')} "
        f"tok/s {num(v.tokens_per_s)} samples/s {num(v.samples_per_s, ',.1f')} "
        f"{mfu_text(v.mfu)} eta {duration(v.eta_s, clock=True)} | batch {v.micro_batch}×"
        f"{v.world_size // max(1, v.sequence_parallel)}×{v.grad_accum}={v.effective_batch}"
    )
    if v.sequence_parallel > 1:  # the data ranks take blocks; each sequence spans the split
        line += f" (sequence ×{v.sequence_parallel})"
    extra = [objective_text(v.objective_doc()), scaling_text(_scaling_doc(v))]
    return " | ".join([line, *(e for e in extra if e)])


def eval_line(e: dict[str, Any]) -> str:
    """One line for an ``eval`` event: "eval step 20: loss 2.3100, ppl 10.1, 5,120 tokens"; a
    preference objective's: "eval step 20: loss 0.5500, 16 pairs, reward accuracy 0.750, …"."""
    ppl = e.get("perplexity")
    best = " (best so far)" if e.get("best") else ""
    figures = objective_text(e)
    if e.get("pairs") or figures:  # a perplexity of a preference loss means nothing
        pairs = f", {int(e.get('pairs') or 0):,} pairs" if e.get("pairs") else ""
        return (
            f"eval step {e.get('step')}: loss {num(e.get('loss'), '.4f')}{pairs}"
            f"{', ' + figures if figures else ''}{best}"
        )
    return (
        f"eval step {e.get('step')}: loss {num(e.get('loss'), '.4f')}, "
        f"ppl {'inf' if ppl is None else format(ppl, ',.1f')}, {int(e.get('tokens') or 0):,} "
        f"tokens{best}"
    )


def eval_summary(last: dict[str, Any] | None) -> str | None:
    """The latest eval and the best one, as `status --json`'s ``eval`` holds them (None: no
    eval yet): "step 20: loss 2.3100, ppl 10.1, 5,120 tokens · best 2.2000 at step 10"."""
    if not last:
        return None
    text = eval_line(last).removeprefix("eval ").removesuffix(" (best so far)")
    if last.get("best_step") is not None and last.get("best_step") != last.get("step"):
        text += f" · best {num(last.get('best_loss'), '.4f')} at step {last['best_step']}"
    return text


def clip(text: str, width: int) -> str:
    """One line of at most ``width`` characters (newlines shown as ⏎, an ellipsis if cut)."""
    flat = text.strip().replace("\n", " ⏎ ")
    return flat if len(flat) <= width else flat[: max(width - 1, 0)] + "…"


def sample_line(e: dict[str, Any], width: int = 60) -> str:
    """The log line of one ``sample`` event: 'sample at step 20 (12 tokens, 0.4 s): "Name a
    colour." → "Red."' (each side clipped to ``width``)."""
    return (
        f"sample at step {e.get('step')} ({e.get('tokens')} tokens, "
        f'{num(e.get("seconds"), ".1f")} s): "{clip(str(e.get("prompt") or ""), width)}" → '
        f'"{clip(str(e.get("text") or ""), width)}"'
    )


def sample_steps(view: RunView) -> list[int]:
    """The steps that have samples, oldest first."""
    return sorted({e.step for e in view.samples})


def samples_text(view: RunView, back: int = 0) -> Text:
    """The Monitor's samples panel: the answers of the latest sampled step (``back`` steps
    with samples earlier: an older one), each beside its prompt; where it is in the list."""
    steps = sample_steps(view)
    out = Text()
    if not steps:
        return out
    step = steps[max(len(steps) - 1 - back, 0)]
    where = "latest" if step == steps[-1] else f"{steps.index(step) + 1} of {len(steps)}"
    out.append(f"samples at step {step} ({where}; s: earlier)\n", style="bold")
    for e in view.samples_at(step):
        out.append("prompt ", style="dim").append(clip(e.prompt, 200) + "\n")
        out.append("answer ", style="dim").append(clip(e.text, 400) or "(empty)", style="cyan")
        out.append(f"  {e.tokens} tokens, {e.seconds:.1f} s\n", style="dim")
    return out


ROLLOUTS_SHOWN = 8
"""The Monitor's completions panel shows this many of the latest step's completions."""


def rollouts_text(rollouts: Rollouts | None, shown: int = ROLLOUTS_SHOWN) -> Text:
    """The Monitor's completions panel (GRPO): the latest generating step's first ``shown``
    completions in prompt order, each with its total reward and each function's."""
    out = Text()
    if rollouts is None or not rollouts.rows:
        return out
    rows = rollouts.rows
    out.append(f"completions at step {rollouts.step} ({len(rows)} in all)\n", style="bold")
    for row in rows[:shown]:
        reward = row.get("reward")
        each = row.get("rewards") or {}
        parts = ", ".join(f"{name} {num(v, '.3f')}" for name, v in each.items())
        out.append(f"prompt {row.get('prompt_index', '?')} ", style="dim")
        out.append(f"reward {num(reward, '.3f')}", style="bold")
        out.append(f" ({parts})  " if parts else "  ", style="dim")
        out.append(clip(str(row.get("completion", "")), 200) or "(empty)", style="cyan")
        out.append("\n")
    if len(rows) > shown:
        out.append(f"… {len(rows) - shown} more in {rollouts.path}", style="dim")
    return out


def device_line(v: RunView) -> str:
    """One line with every device."""
    parts = []
    for key, d in sorted(v.devices.items()):
        mem = format_bytes(d.memory_used) if d.memory_used is not None else "–"
        bits = [f"{key} {num(d.utilization_pct)}%", f"mem {mem}"]
        if d.temperature_c is not None:
            bits.append(f"{d.temperature_c:.0f}°C")
        if d.power_w is not None:
            bits.append(f"{d.power_w:.0f} W")
        parts.append(" ".join(bits))
    energy = f" | energy {v.energy_wh:.2f} Wh" if v.energy_wh else ""
    return " | ".join(parts) + energy


def event_line(e: dict[str, Any], v: RunView) -> str | None:
    """The log line of one event already folded into ``v``; None for events not logged."""
    kind = e.get("type")
    if kind == "step":
        return step_line(v)
    if kind == "devices":
        return device_line(v)
    if kind == "start":
        n, every = int(e.get("eval_blocks") or 0), int(e.get("eval_every") or 0)
        when = f"every {every} steps and at the end" if every else "at the end"
        evals = f", evaluating {n} block{'s' if n != 1 else ''} {when}" if n else ""
        attention = f", attention {e['attention']}" if e.get("attention") else ""
        packing = f", packing {e['packing']}" if e.get("packing") else ""
        packing += split_text(int(e.get("sequence_parallel") or 1))
        objective = ""
        if e.get("objective") and e.get("objective") != "sft":
            ref = f" (reference: {e['reference']})" if e.get("reference") else ""
            objective = f" · {e['objective']}{ref}"
        return (
            f"started {v.run_id}: {v.method}{objective} · {v.distribution}, "
            f"{v.world_size} process(es), {v.total_steps} steps{evals}{attention}{packing}"
        )
    if kind == "eval":
        return eval_line(e)
    if kind == "sample":
        return sample_line(e)
    if kind == "checkpoint":
        return f"checkpoint at step {e.get('step')}: {e.get('path')}"
    if kind in ("straggler", "warning", "retry"):
        detail = e.get("message") or e.get("reason")
        return f"{'retry' if kind == 'retry' else 'warning'}: {detail}"
    if kind in ("error", "end", "state"):
        return f"{kind}: {e.get('message') or e.get('reason') or e.get('status')}"
    return None


def final_text(v: RunView, state: dict[str, Any]) -> str:
    """How the run ended (state.json's status and reason) and where its result is."""
    text = f"run {v.run_id} {state.get('status')}: {state.get('reason') or ''}".strip()
    if v.final_path:
        text += f"\nresult: {v.final_path}"
    return text


# ---------------------------------------------------------------------- the CLI's live panel
def live_panel(v: RunView) -> Panel:
    """The panel a terminal shows while `run` or `attach` follows the run."""
    head = Table.grid(padding=(0, 2))
    head.add_row(
        f"[bold]{v.run_id}[/]",
        f"status [bold]{v.status}[/] · {v.method} · {v.distribution}",
    )
    stats = Table.grid(padding=(0, 2))
    trend = v.loss_trend
    arrow = "" if trend is None else ("[green]↓[/]" if trend < 0 else "[red]↑[/]")
    stats.add_row(
        f"step {v.step}/{v.total_steps}",
        f"loss {num(v.loss, '.4f')} {arrow}",
        f"lr {num(v.lr, '.2e')}",
        f"ETA {duration(v.eta_s, clock=True)}",
    )
    stats.add_row(
        f"tok/s {num(v.tokens_per_s)}",
        f"samples/s {num(v.samples_per_s, ',.1f')}",
        f"step {num(v.step_time_s, '.2f')} s",
        f"tokens {v.tokens:,}",
        mfu_text(v.mfu),
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
            f"{num(d.utilization_pct)}%",
            mem,
            est,
            f"{d.temperature_c:.0f}°C" if d.temperature_c is not None else "–",
            f"{d.power_w:.0f} W" if d.power_w is not None else "–",
            f"{d.energy_wh:.2f} Wh" if d.energy_wh else "–",
        )
    lines: list[RenderableType] = [head, stats, progress, accum, devices]
    figures = objective_text(v.objective_doc())
    if figures:
        lines.insert(2, figures)
    speed = [scaling_text(_scaling_doc(v), _predicted_speedup(v)),
             comm_text(_scaling_doc(v), _predicted_exposed(v)),
             prediction_text(v.speed_doc())]  # fmt: skip
    if any(speed):
        lines.insert(len(lines) - 1, " · ".join(t for t in speed if t))
    evals = eval_summary(v.eval_doc())
    if evals:
        lines.insert(2, f"eval {evals}")
    latest = v.sample_doc()
    if latest:  # Text, not markup: prompts and answers may hold "[…]"
        lines.insert(3 if evals else 2, Text(sample_line(latest, 50)))
    if v.energy_wh:
        cost = f" · {v.cost:.3f} {v.currency}" if v.cost is not None else ""
        per = f" · {v.tokens_per_wh:,.0f} tokens/Wh" if v.tokens_per_wh else ""
        lines.append(f"energy {v.energy_wh:.2f} Wh{per}{cost}")
    for warning in v.stragglers.values():  # Text, not markup: messages may hold "[…]"
        lines.append(Text(f"straggler: {warning}", style="yellow"))
    if v.error:
        lines.append(Text(v.error, style="red"))
    return Panel(Group(*lines), title="homelab-dp", subtitle="Ctrl-C detaches; the run goes on")


# ---------------------------------------------------------------------- the TUI's Monitor
def head_text(view: RunView, width: int = 30) -> Text:
    """Run id and status, then step progress, ETA, loss with its trend, lr and energy."""
    out = Text()
    out.append(view.run_id, style="bold")
    out.append("  ")
    out.append(view.status, style=STATUS_STYLE.get(view.status, "bold"))
    if view.method:  # a visible separator: whitespace alone vanishes in some SVG renderings
        out.append(f" · {view.method} · {view.distribution} · world {view.world_size}")
        if view.sequence_parallel > 1:
            out.append(f" · sequence split ×{view.sequence_parallel}")
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


def speed_text(view: RunView) -> Text:
    """The Monitor's speed line: measured scaling ("scaling 1.82× of 2 (91%)"), the
    communication share, and the plan's prediction beside the measurement (empty when the run
    has one process and a plan without a prediction)."""
    scaling = _scaling_doc(view)
    out = Text()
    head = scaling_text(scaling, _predicted_speedup(view))
    if head:
        efficiency = scaling["efficiency"] if scaling else 1.0
        out.append(head, style="bold green" if efficiency >= 0.8 else "bold yellow")
        comm = comm_text(scaling, _predicted_exposed(view))
        if comm:
            out.append(f" · {comm}")
        out.append(f" (median of {scaling['steps'] if scaling else 0} steps)", style="dim")
    predicted = prediction_text(view.speed_doc())
    if predicted:
        out.append("\n" if out else "").append(predicted)
    return out


def stragglers_text(view: RunView) -> Text:
    """The straggler warnings, one a line (empty when none)."""
    out = Text()
    for rank in sorted(view.stragglers):
        if out:
            out.append("\n")
        out.append(f"⚠ {view.stragglers[rank]}", style="bold yellow")
    return out
