"""The plan's host-RAM step: the ``host`` block of a plan, and what to say when the machine cannot
hold the run although its cards can (pure; the model is `homelab_dp.core.host_memory`).
"""

from __future__ import annotations

from dataclasses import replace

from homelab_dp.core.hardware import format_bytes
from homelab_dp.core.host_memory import HostBudget, host_budget
from homelab_dp.core.planner import Plan, train_shape
from homelab_dp.core.preset import Preset
from homelab_dp.core.vocabulary import SHARDED


def with_host(p: Plan, preset: Preset, available: int | None) -> Plan:
    """``p`` with the host RAM its chosen option needs (`homelab_dp.core.host_memory.host_budget`).

    ``available``: the machine's available RAM (None: not known, not checked). When the machine
    cannot hold the peak, the plan does not fit; when that is all that does not fit, the
    "Chosen:" reason says why and the advice what would help (a plan already too big for its
    devices keeps its words: the host block still shows the figures).
    """
    c = p.chosen
    shape = train_shape(preset, p.hardware, c.method, c.distribution, c.activation_checkpointing,
                   micro_batch=p.micro_batch, grad_accum=p.grad_accum)  # fmt: skip
    host = host_budget(p.spec, shape, c.budget, merge=preset.train.merge, available=available)
    if host.fits or not c.fits:
        return replace(p, host=host)
    problem, remedy = host_words(host, c.method, c.distribution)
    for other in p.candidates:  # a sharded option of the same method that fits both
        if other.method != c.method or other.distribution not in SHARDED:
            continue
        if other.distribution == c.distribution or not other.fits:
            continue
        o = train_shape(preset, p.hardware, other.method, other.distribution,
                   other.activation_checkpointing, micro_batch=p.micro_batch,
                   grad_accum=p.grad_accum)  # fmt: skip
        if host_budget(p.spec, o, other.budget, merge=preset.train.merge, available=available).fits:
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


def host_words(host: HostBudget, method: str, distribution: str) -> tuple[str, str]:
    """(what the host RAM is short of, what would help) for a host peak that does not fit."""
    need, have = format_bytes(host.total_bytes), format_bytes(host.available_bytes or 0)
    phase, n = host.peak_phase, host.processes
    sharded = distribution in SHARDED and method != "qlora"
    if phase == "load" and not sharded:
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
