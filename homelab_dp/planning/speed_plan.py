"""The plan's speed: the time model (`homelab_dp.planning.time_model`) applied to every option of
a plan, and what it means in words — the advice (pure).

The advice speaks of the chosen option on several devices: how much faster than one device
("2 cards ≈ 1.8× one card"), what costs the time when the scaling efficiency is under
`GOOD_EFFICIENCY` (the communication, over which link, and how much accumulation would hide
it; the offload copies), when one device with accumulation beats them all, and how much the
slowest of mixed cards holds the others back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from homelab_dp.byte_units import format_bytes
from homelab_dp.planning import grpo_plan
from homelab_dp.planning.batch_shape import BatchShape
from homelab_dp.planning.links import LinkSpeed
from homelab_dp.planning.plan_result import Candidate, Plan
from homelab_dp.planning.planner import supported, train_shape
from homelab_dp.planning.speed_calibration import ComputeRate
from homelab_dp.planning.time_model import GOOD_EFFICIENCY, Prediction, predict
from homelab_dp.presets.preset import Preset

RateOf = Callable[[str, bool], ComputeRate]
"""(method, activation checkpointing) → the compute rate to price it at
(`homelab_dp.planning.speed_calibration.SpeedStore.rate_for` of this machine)."""

ACCUMULATIONS = (2, 4, 8, 16, 32, 64)
"""Accumulation values the advice tries when communication costs the scaling."""
SLOWER = 0.95
"""Below this speedup one device with accumulation is worth naming as the faster choice."""
MATERIAL = 0.05
"""A share of the step below this is not worth a sentence."""


def predict_candidate(
    p: Plan, preset: Preset, c: Candidate, link: LinkSpeed, rate_of: RateOf, grad_accum: int = 0
) -> Prediction | None:
    """The time model's answer for candidate ``c`` at the plan's micro-batch and accumulation
    (or ``grad_accum``); None for an option the worker cannot train here."""
    if (
        not c.supported
        or not supported(c.method, c.distribution, p.hardware, p.dtype, c.offload)[0]
    ):
        return None
    shape = train_shape(preset, p.hardware, c.method, c.distribution, c.activation_checkpointing,
                        micro_batch=p.micro_batch, grad_accum=grad_accum or p.grad_accum,
                        seq_len=p.seq_len, offload=c.offload,
                        offload_activations=c.offload_activations,
                        tiled_mlp=c.tiled_mlp)  # fmt: skip
    off = c.offload_cost.pcie_seconds_per_step if c.offload_cost else 0.0
    off *= (grad_accum or p.grad_accum) / p.grad_accum if c.offload_activations else 1.0
    pred = predict(p.spec, shape, p.hardware, link=link,
                   rate=rate_of(c.method, c.activation_checkpointing), offload_seconds=off)  # fmt: skip
    if shape.objective == "grpo":  # the step's generation (`planning.grpo_plan`)
        pred = grpo_plan.with_generation(p.spec, preset, shape, p.hardware, pred)
    return pred


def with_predictions(p: Plan, preset: Preset, link: LinkSpeed, rate_of: RateOf) -> Plan:
    """``p`` with a prediction on its chosen option and every candidate, and the speed advice."""
    chosen = replace(p.chosen, predicted=predict_candidate(p, preset, p.chosen, link, rate_of))
    cands = tuple(
        replace(c, predicted=predict_candidate(p, preset, c, link, rate_of)) for c in p.candidates
    )
    out = replace(p, chosen=chosen, candidates=cands)
    advice = speed_advice(out, preset, link, rate_of)
    if chosen.predicted is not None and chosen.predicted.generation_engine:
        shape = train_shape(preset, p.hardware, chosen.method, chosen.distribution,
                            chosen.activation_checkpointing, micro_batch=p.micro_batch,
                            grad_accum=p.grad_accum, seq_len=p.seq_len)  # fmt: skip
        advice.insert(0, grpo_plan.generation_words(p.spec, preset, shape, p.hardware,
                                                    chosen.predicted))  # fmt: skip
    return replace(out, speed_advice=tuple(advice))


def _times(x: float) -> str:
    return f"{x:.1f}×" if x < 10 else f"{x:.0f}×"


def speed_advice(p: Plan, preset: Preset, link: LinkSpeed, rate_of: RateOf) -> list[str]:
    """The advice sentences about the chosen option's speed (none on one device)."""
    pred = p.chosen.predicted
    n = p.world_size
    if pred is None or n < 2 or not p.chosen.fits:
        return []
    cpu = p.hardware.kind == "cpu"
    one, many = ("process", "processes") if cpu else ("card", "cards")
    head = f"{n} {many} ≈ {_times(pred.speedup_vs_one_device)} one {one}"
    head += f" ({pred.scaling_efficiency:.0%} scaling efficiency"
    head += f", {pred.bottleneck}-bound)" if pred.bottleneck != "compute" else ")"
    if link.kind == "host-bounce":
        head = f"These cards have no P2P: {head}"
    out: list[str] = []
    step = pred.step_seconds or 1.0
    comm_share = pred.exposed_comm_seconds / step
    if pred.scaling_efficiency < GOOD_EFFICIENCY and comm_share >= MATERIAL:
        head += (
            f"; communication takes {comm_share:.0%} of each step "
            f"({format_bytes(pred.comm_bytes_per_step)} per step over {link.words})"
        )
        better = _better_accumulation(p, preset, link, rate_of)
        if better is not None:
            g, q = better
            eff = BatchShape.of(p.micro_batch, n, g, p.sequence_parallel).effective
            head += (
                f"; grad_accum {g} brings it to {_times(q.speedup_vs_one_device)} "
                f"(effective batch {eff}: set train.grad_accum = {g}, or lower train.micro_batch "
                "and keep the batch)"
            )
    out.append(head + ".")
    if cpu and pred.scaling_efficiency < GOOD_EFFICIENCY and comm_share < MATERIAL:
        threads = pred.assumptions.get("threads_per_process")
        out.append(
            f"The {n} processes share this machine's cores ({threads} thread(s) each): more "
            "processes split the same compute, so they add little but communication."
        )
    if pred.speedup_vs_one_device < SLOWER:
        all_ = "both" if n == 2 else f"all {n}"
        out.append(
            f"One {one} with accumulation is faster than {all_}: the same effective batch on "
            f"one {one} (train.grad_accum × {n}) trains "
            f"{1 / max(pred.speedup_vs_one_device, 1e-9):.1f}× as fast as the {n} {many} "
            "(if it fits its memory)."
        )
    if pred.straggler_wait >= MATERIAL:
        out.append(
            f"The slowest card ({pred.pace_device}) sets the pace: the faster card waits about "
            f"{pred.straggler_wait:.0%} of each step's compute for it at every synchronisation."
        )
    off_share = pred.offload_seconds / step
    if pred.scaling_efficiency < GOOD_EFFICIENCY and off_share >= MATERIAL:
        out.append(f"Offload copies take {off_share:.0%} of each step over PCIe (they do not "
                   "overlap the compute).")  # fmt: skip
    return out


def _better_accumulation(
    p: Plan, preset: Preset, link: LinkSpeed, rate_of: RateOf
) -> tuple[int, Prediction] | None:
    """The smallest accumulation above the plan's that reaches `GOOD_EFFICIENCY`, else the
    one that helps most; None when more accumulation does not help (FSDP gathers every
    micro-step)."""
    base = p.chosen.predicted
    assert base is not None
    best: tuple[int, Prediction] | None = None
    for g in (x for x in ACCUMULATIONS if x > p.grad_accum):
        q = predict_candidate(p, preset, p.chosen, link, rate_of, grad_accum=g)
        if q is None:
            return None
        if q.scaling_efficiency >= GOOD_EFFICIENCY:
            return g, q
        if best is None or q.scaling_efficiency > best[1].scaling_efficiency:
            best = (g, q)
    if best is None or best[1].scaling_efficiency < base.scaling_efficiency + 0.05:
        return None
    return best
