"""Memory other processes hold on the local cards: what the plan says about it.

What a plan budgets on a local card (`PlanDevice.budget`): the smaller of the planner's safety
margin of the whole card (95%) and the card's free memory at probe time less `free_margin`
(max(256 MiB, 2% of the card)), because other processes' memory moves between the probe and the
run's peak. On an idle card the 95% is the smaller, so idle cards plan as before; a desktop
session, an inference server or another fine-tune lowers it. What-if cards (``--gpus``) and the
CPU have no free memory recorded and keep budgeting the whole device.

When other processes make the plan smaller or make it not fit, the planner plans again on the
same cards idle (`PlanHardware.idle`) and these words say what that plan would be.
"""

from __future__ import annotations

from collections.abc import Sequence

from homelab_dp.core.hardware import GpuProcess, PlanDevice, PlanHardware, format_bytes, free_margin
from homelab_dp.core.plan_reasons import PLAIN, Option


def process_text(p: GpuProcess) -> str:
    """A process in words: ``python3 (pid 48211, 6.00 GiB)``, or ``another homelab-dp run: ID
    (pid …, …)`` for one of ours."""
    used = format_bytes(p.used_bytes) if p.used_bytes is not None else "memory n/a"
    who = f"another homelab-dp run: {p.run_id}" if p.run_id else p.name or "unknown process"
    return f"{who} (pid {p.pid}, {used})"


def holders(d: PlanDevice) -> str:
    """Who holds memory on ``d``: its processes, or why none are named."""
    if d.processes:
        return ", ".join(process_text(p) for p in d.processes)
    if d.processes is None:
        return "processes NVML does not list (no permission, or not supported)"
    return "no listed process (the driver, or processes in another container)"


def held_reasons(hw: PlanHardware, margin: float) -> list[str]:
    """One line per local card whose budget is cut by what others hold on it."""
    out = []
    for i in hw.limited(margin):
        d = hw.devices[i]
        free = d.free_bytes or 0
        out.append(
            f"{hw.label(i)}: {format_bytes(d.held_bytes)} of {format_bytes(d.memory_bytes)} in "
            f"use by {holders(d)}; the plan budgets the {format_bytes(free)} free less a "
            f"{format_bytes(free_margin(d.memory_bytes))} margin: {format_bytes(d.budget(margin))}."
        )
    return out


def _held_by(hw: PlanHardware, positions: Sequence[int]) -> str:
    """Per card: ``6.25 GiB held on GPU 1 (…) by python3 (pid 48211, 6.00 GiB)``."""
    return "; ".join(
        f"{format_bytes(hw.devices[i].held_bytes)} held on {hw.label(i)} by "
        f"{holders(hw.devices[i])}"
        for i in positions
    )


def _option(c: Option) -> str:
    ck = "with" if c.activation_checkpointing else "without"
    return f"{PLAIN[c.method]} with {PLAIN[c.distribution]}, {ck} activation checkpointing"


def idle_advice(hw: PlanHardware, margin: float, idle: Option) -> str:
    """Why a plan that does not fit now would fit the same cards idle (``idle`` fits there):
    the cards whose budget is below what that plan needs, and who holds memory there."""
    limited = hw.limited(margin)
    need = idle.budget.total
    blocking = [i for i in limited if hw.devices[i].budget(margin) < need] or limited
    return (
        f"Fits when the other processes are gone: {_held_by(hw, blocking)}. On the idle "
        f"cards: {_option(idle)}, {format_bytes(idle.budget.total)} per device."
    )


def idle_choice_reason(idle: Option) -> str:
    """Why the plan chose something else than it would on the same cards idle."""
    return (
        f"On idle cards the plan would be {_option(idle)} "
        f"({format_bytes(idle.budget.total)} per device); the memory others hold (above) rules "
        "it out."
    )
