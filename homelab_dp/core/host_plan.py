"""The plan's host-RAM step: the ``host`` block of a plan, and what to say when the machine cannot
hold the run although its cards can (pure; the model is `homelab_dp.core.host_memory`).
"""

from __future__ import annotations

from dataclasses import replace

from homelab_dp.core.hardware import format_bytes
from homelab_dp.core.host_memory import HostBudget, host_budget
from homelab_dp.core.planner import Candidate, Plan, offloading, plan, train_shape
from homelab_dp.core.preset import Preset
from homelab_dp.core.vocabulary import SHARDED


def with_host(p: Plan, preset: Preset, available: int | None) -> Plan:
    """``p`` with the host RAM its chosen option needs (`homelab_dp.core.host_memory.host_budget`).

    ``available``: the machine's available RAM (None: not known, not checked). When the machine
    cannot hold the peak, the plan does not fit; when that is all that does not fit, the
    "Chosen:" reason says why and the advice what would help (a plan already too big for its
    devices keeps its words: the host block still shows the figures).
    """
    host = _host(p, preset, p.chosen, available)
    if not host.fits and available is not None and offloading(p.chosen):
        # The choice offloads more than this machine can pin: plan again with its RAM known,
        # so that an option whose host RAM fits is chosen, if there is one.
        p = _replanned(p, preset, available)
        host = _host(p, preset, p.chosen, available)
    c = p.chosen
    if host.fits or not c.fits:
        return replace(p, host=host)
    problem, remedy = host_words(host, c.method, c.distribution)
    for other in p.candidates if host.peak_phase == "load" else ():
        # a sharded option of the same method that fits both (it loads one copy)
        if other.method != c.method or other.distribution not in SHARDED:
            continue
        if other.distribution == c.distribution or not other.fits:
            continue
        if _host(p, preset, other, available).fits:
            remedy = (f"train.distribution = {other.distribution!r} fits the devices and loads "
                      "one copy of the model (on rank 0); or free memory or add swap")  # fmt: skip
            break
    reasons = tuple(
        f"{r[:-1] if r.endswith('.') else r}, but the host RAM does not: {problem}."
        if r.startswith("Chosen:")
        else r
        for r in p.reasons
    )
    return replace(p, host=host, reasons=reasons, advice=(*p.advice, f"Host RAM: {remedy}."))


def _host(p: Plan, preset: Preset, c: Candidate, available: int | None) -> HostBudget:
    shape = train_shape(preset, p.hardware, c.method, c.distribution, c.activation_checkpointing,
                        micro_batch=p.micro_batch, grad_accum=p.grad_accum, offload=c.offload,
                        offload_activations=c.offload_activations)  # fmt: skip
    return host_budget(p.spec, shape, c.budget, merge=preset.train.merge, available=available)


def _replanned(p: Plan, preset: Preset, available: int) -> Plan:
    """``p`` planned again knowing the machine's RAM (at its micro-batch and accumulation, as
    the micro-batch finder chose them: `homelab_dp.core.finder`)."""
    t = preset.train
    if p.fit is not None:
        requested = t.micro_batch * p.hardware.world_size * t.grad_accum
        t = replace(t, micro_batch=p.micro_batch, grad_accum=p.grad_accum,
                    reference_batch=t.reference_batch or requested)  # fmt: skip
    again = plan(p.spec, replace(preset, train=t), p.hardware, p.calibration,
                 host_available=available)  # fmt: skip
    if p.fit is not None:
        again = replace(again, fit=p.fit, reasons=(*again.reasons, p.fit.describe()))
    return again


def host_words(host: HostBudget, method: str, distribution: str) -> tuple[str, str]:
    """(what the host RAM is short of, what would help) for a host peak that does not fit."""
    need, have = format_bytes(host.total_bytes), format_bytes(host.available_bytes or 0)
    phase, n = host.peak_phase, host.processes
    sharded = distribution in SHARDED
    if phase == "train":
        what = (f"training needs {need} on this machine ({n} processes × their offloaded state "
                "in pinned host memory, which cannot be swapped)")  # fmt: skip
        remedy = ("offload less (train.offload = 'optimizer' or 'none', "
                  "train.offload_activations = false), use more cards (smaller shards) "
                  "or free memory")  # fmt: skip
    elif phase == "load" and not sharded:
        what = f"loading needs {need} on this machine ({n} processes × a full copy)"
        remedy = (
            "use FSDP (train.distribution = 'fsdp-full' loads one copy, on rank 0), "
            "free memory or add swap"
            if method != "qlora"
            else "free memory or add swap"
        )
    elif phase == "load":
        what = f"loading needs {need} on this machine (rank 0 reads one full copy)"
        remedy = "free memory or add swap"
    elif phase == "checkpoint":
        what = f"saving the result needs {need} on this machine (rank 0 holds the whole model)"
        remedy = "free memory or add swap"
    else:
        what = f"merging the adapter needs {need} on this machine (rank 0 loads the base again)"
        remedy = "set train.merge = false (merge later, on a machine with more RAM) or add swap"
    return f"{what} but {have} is available", remedy
