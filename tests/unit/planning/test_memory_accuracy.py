"""The memory model within 10% of measured live tensor bytes; the tracker that measures them.

A few cases of `benchmarks/memory_accuracy.py`'s grid, one per kind of peak: the start of
backward (logits), inside backward (a recomputed layer, small vocabulary), the end of backward
(a tied embedding's second gradient), the optimizer phase (checked alone: fused AdamW makes
no temporary, so it no longer peaks), accumulation and padding. Each runs
the worker's own step in this process (`homelab_dp.measure.memcheck`). Mixture-of-Experts
(tiny Qwen3-MoE, Mixtral and gpt-oss, transformers' grouped_mm experts): every expert's weights,
gradients and AdamW state and the routed tokens' activations within 5%.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from homelab_dp.measure.memcheck import (  # noqa: E402
    FAMILIES,
    GRID,
    HELD_OUT_FAMILIES,
    HELD_OUT_GRID,
    Case,
    estimate,
    measure_case,
)
from homelab_dp.train.loop.memtrack import LiveTensors, MemoryProbe  # noqa: E402

BOUND = 0.10
MOE_BOUND = 0.05
CASES = {
    "llama-gqa b4 s128": "backward",  # start of backward: 3 × b·s·V fp32
    "gpt2 b4 s128 ckpt": "backward",  # inside backward: one recomputed layer
    "qwen2-tied b1 s64": "backward",  # end of backward: the tied embedding's two gradients
    # Weights, buckets, grads, m and v: fused AdamW makes no temporary (issue 33), so with m and
    # v alive from step 1 on the step's peak is backward's; the optimizer phase is checked alone.
    "llama-gqa b1 s64": "backward",
    "qwen2-tied b2 s128 acc2 ckpt": "backward",  # accumulated gradients alive
    "llama-gqa b4 s128 pad": "backward",  # a padding mask per layer, repeated kv heads
}
OPTIMIZER_PHASE = {"llama-gqa b1 s64", "qwen3-moe b1 s64"}
"""Cases whose optimizer phase (weights, gradients, m and v) is checked on its own too."""


def _optimizer_phase_error(r: object) -> float:
    measured = r.phases["optimizer"]["peak_bytes"]  # type: ignore[attr-defined]
    return (r.estimate.phases["optimizer"] - measured) / measured  # type: ignore[attr-defined]


@pytest.mark.parametrize("name", list(CASES))
def test_estimate_within_ten_percent_of_the_measured_peak(name: str) -> None:
    case = next(c for c in GRID if c.name == name)
    r = measure_case(case, steps=2)
    assert abs(r.error) <= BOUND, f"{name}: estimate {r.estimate.tensors}, measured {r.measured}"
    assert r.estimate.peak_phase == r.measured_phase == CASES[name]
    if name in OPTIMIZER_PHASE:
        assert abs(_optimizer_phase_error(r)) <= BOUND
    # Weights and optimizer state are exact: fp32 parameters and AdamW's m and v.
    load = r.phases["load"]["end_bytes"]
    assert abs(load - r.estimate.phases["load"]) / load < 0.01


MOE_CASES: dict[str, tuple[str, ...]] = {
    "qwen3-moe b4 s128": ("backward",),  # routed activations and the logits at backward's start
    "qwen3-moe b1 s64": ("backward",),  # every expert's weights, gradients, m and v (+ acts)
    "mixtral b4 s128": ("backward",),
    # LoRA on attention, experts and router frozen: the routed slots save less. The forward's
    # and the backward's measured peaks are within bytes of each other here.
    "qwen3-moe b4 s128 lora": ("forward", "backward"),
    "mixtral b4 s128 ckpt lora": ("forward", "backward"),
    "gpt-oss b4 s128": ("backward",),  # the clamped gate's routed tensors, attention sinks
}


@pytest.mark.parametrize("name", list(MOE_CASES))
def test_moe_estimate_within_five_percent_of_the_measured_peak(name: str) -> None:
    case = next(c for c in GRID if c.name == name)
    r = measure_case(case, steps=2)
    assert abs(r.error) <= MOE_BOUND, (
        f"{name}: estimate {r.estimate.tensors}, measured {r.measured}"
    )
    assert r.estimate.peak_phase in MOE_CASES[name] and r.measured_phase in MOE_CASES[name]
    if name in OPTIMIZER_PHASE:
        assert abs(_optimizer_phase_error(r)) <= MOE_BOUND
    load = r.phases["load"]["end_bytes"]  # every expert loaded, exactly
    assert abs(load - r.estimate.phases["load"]) / load < 0.01


# The constants marked "(measured)" in the memory model were fitted on GRID: here they meet
# families and shapes they never saw (GPT-2 without recomputation included: +24% before the
# attention-dropout term counted the keys of each sample rather than of the whole row).
@pytest.mark.parametrize("name", [c.name for c in HELD_OUT_GRID])
def test_held_out_estimate_within_ten_percent_of_the_measured_peak(name: str) -> None:
    case = next(c for c in HELD_OUT_GRID if c.name == name)
    r = measure_case(case, steps=2)
    assert r.error >= -BOUND, f"{name}: under-estimated, {r.estimate.tensors} < {r.measured}"
    assert abs(r.error) <= BOUND, f"{name}: estimate {r.estimate.tensors}, measured {r.measured}"


def test_the_held_out_grid_is_disjoint_from_the_fitted_one() -> None:
    assert not set(HELD_OUT_FAMILIES) & set(FAMILIES)
    assert not [c for c in HELD_OUT_FAMILIES.values() if c in FAMILIES.values()]
    assert not {(c.micro_batch, c.seq_len, c.grad_accum) for c in HELD_OUT_GRID} & {
        (c.micro_batch, c.seq_len, c.grad_accum) for c in GRID
    }
    assert {c.activation_checkpointing for c in HELD_OUT_GRID} == {False, True}


def test_the_grid_covers_six_families_checkpointing_and_shapes() -> None:
    moe = {"qwen3-moe", "mixtral", "gpt-oss"}
    assert {c.family for c in GRID} == {"llama-gqa", "qwen2-tied", "gpt2"} | moe
    assert {c.family for c in GRID if c.method == "lora"} == moe
    assert {c.activation_checkpointing for c in GRID} == {False, True}
    assert len({(c.micro_batch, c.seq_len) for c in GRID}) >= 4
    est = estimate(Case("gpt2", 4, 128))
    assert est.logits > 0 and est.activations > est.weights  # every term matters in the grid


def test_tracker_counts_each_storage_once_and_forgets_dead_ones() -> None:
    with LiveTensors() as t:
        x = torch.zeros(256, 256)  # 256 KiB
        assert t.current == 256 * 1024
        v = x.view(-1)[:10]  # a view: no new storage
        y = x * 2
        assert t.current == 2 * 256 * 1024
        del x
        assert t.current == 2 * 256 * 1024  # the view keeps the storage alive
        del v
        assert t.current == 256 * 1024
        del y
        assert t.current == 0 and t.peak == 2 * 256 * 1024


def test_tracker_follows_storage_resizes() -> None:
    with LiveTensors() as t:
        x = torch.zeros(1024)
        x.untyped_storage().resize_(0)  # what FSDP2 does to free unsharded parameters
        assert t.current == 0
        x.untyped_storage().resize_(4096)
        assert t.current == 4096 and t.peak == 4096


def test_probe_phases_keep_their_largest_peak_and_categories() -> None:
    w = torch.nn.Parameter(torch.zeros(1000))
    probe = MemoryProbe(torch.device("cpu"))
    probe.start({"weights": [w]})
    probe.state = lambda: {"weights": [w], "gradients": [w.grad] if w.grad is not None else []}
    big = torch.ones(4000)
    del big
    probe.mark("forward")
    (w * 2).sum().backward()
    probe.mark("backward")
    small = torch.ones(10)
    del small
    probe.mark("forward")  # a smaller second occurrence does not replace the first
    probe.stop()
    out = probe.to_json()
    assert out["phases"]["forward"]["peak_bytes"] == 4000 + 16000
    assert out["peak_phase"] == "forward" and out["peak_bytes"] == 20000
    assert out["phases"]["backward"]["end_bytes"] >= 8000  # weights and their gradient
    assert out["process_peak_bytes"] > 0  # the resident-set peak, for the overhead calibration
