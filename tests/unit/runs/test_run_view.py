"""RunView: folding events and device samples into the figures a follower shows."""

from __future__ import annotations

from dataclasses import fields

import pytest

from homelab_dp.runs.run_events import GRPO_FIGURES, OBJECTIVE_FIGURES, EvalEvent, StepEvent
from homelab_dp.runs.run_view import STRAGGLER_STEPS, RunView


def _step(step: int, loss: float, times: list[float], **kw) -> dict:
    return {
        "type": "step",
        "time": 100.0 + step,
        "step": step,
        "total_steps": 50,
        "loss": loss,
        "lr": 1e-3,
        "tokens_per_s": 1000.0,
        "samples_per_s": 4.0,
        "step_time_s": 2.0,
        "micro_batch": 2,
        "grad_accum": 4,
        "world_size": 2,
        "effective_batch": 16,
        "rank_step_times_s": times,
        "peak_memory_bytes": [10, 12],
        "tokens": step * 512,
        **kw,
    }


def test_steps_give_progress_eta_and_loss_trend() -> None:
    v = RunView()
    v.apply(
        {
            "type": "start",
            "time": 100.0,
            "total_steps": 50,
            "world_size": 2,
            "method": "full",
            "distribution": "ddp",
            "estimate": {"total": 999},
        }
    )
    for i, loss in enumerate([4.0, 3.8, 3.5, 3.1, 2.9, 2.6], start=1):
        v.apply(_step(i, loss, [2.0, 2.0]))
    assert (v.step, v.total_steps, v.loss, v.estimate_bytes) == (6, 50, 2.6, 999)
    assert v.eta_s == pytest.approx(44 * 2.0)
    assert v.loss_trend == pytest.approx((3.1 + 2.9 + 2.6) / 3 - (4.0 + 3.8 + 3.5) / 3)
    assert v.effective_batch == 16 == v.micro_batch * v.world_size * v.grad_accum
    assert v.elapsed_s == pytest.approx(6.0)


def test_a_rank_slow_for_several_steps_is_flagged_and_cleared() -> None:
    v = RunView()
    for i in range(1, STRAGGLER_STEPS):
        v.apply(_step(i, 1.0, [1.0, 1.0, 1.5]))
    assert v.stragglers == {}  # not yet: slow for fewer than STRAGGLER_STEPS steps
    v.apply(_step(STRAGGLER_STEPS, 1.0, [1.0, 1.0, 1.5]))
    assert list(v.stragglers) == [2] and "50% slower" in v.stragglers[2]
    v.apply(_step(STRAGGLER_STEPS + 1, 1.0, [1.0, 1.0, 1.1]))  # within 20%: cleared
    assert v.stragglers == {}


def test_micro_steps_and_end() -> None:
    v = RunView()
    v.apply({"type": "micro", "micro_step": 3, "grad_accum": 4})
    assert (v.micro_step, v.grad_accum) == (3, 4)
    v.apply(_step(1, 2.0, [1.0, 1.0]))
    assert v.micro_step == 0
    v.apply({"type": "end", "reason": "completed", "final_loss": 1.5, "final_path": "/x/final"})
    assert (v.status, v.loss, v.final_path) == ("completed", 1.5, "/x/final")


def test_device_samples_energy_and_cost() -> None:
    v = RunView(per_kwh=0.30)
    v.apply(_step(1, 2.0, [1.0, 1.0]))
    v.apply(
        {
            "type": "devices",
            "time": 1.0,
            "energy_wh": 250.0,
            "devices": [
                {
                    "key": "gpu0",
                    "utilization_pct": 97,
                    "memory_used": 5,
                    "power_w": 300,
                    "energy_wh": 125.0,
                },
                {"key": "gpu1", "utilization_pct": 95, "energy_wh": 125.0},
            ],
        }
    )
    assert v.devices["gpu0"].utilization_pct == 97 and v.devices["gpu1"].energy_wh == 125.0
    assert v.energy_wh == 250.0
    assert v.cost == pytest.approx(0.075)
    assert v.tokens_per_wh == pytest.approx(512 / 250.0)


def test_unknown_and_error_events() -> None:
    v = RunView()
    v.apply({"type": "something-new", "time": 5})
    v.apply({"type": "error", "message": "CUDA out of memory", "rank": 1})
    assert v.status == "failed" and v.error == "CUDA out of memory" and v.events_seen == 2


def test_straggler_detector_reports_each_rank_once_per_episode() -> None:
    from homelab_dp.runs.run_view import StragglerDetector

    d = StragglerDetector()
    slow = [1.0, 1.0, 1.3]
    assert [d.update(slow) for _ in range(STRAGGLER_STEPS)][-1] == [2]
    assert d.update(slow) == []  # still slow: already reported
    d.update([1.0, 1.0, 1.0])  # recovered
    assert d.flagged == {}
    assert [d.update(slow) for _ in range(STRAGGLER_STEPS)][-1] == [2]


def test_the_figure_lists_name_the_events_own_optional_fields() -> None:
    """One list of each objective's figures (run_events) for the view and the metric loggers:
    every name is an optional float of the events that carry it."""
    step = {f.name: f.type for f in fields(StepEvent)}
    evals = {f.name: f.type for f in fields(EvalEvent)}
    for name in OBJECTIVE_FIGURES:
        assert step[name] == evals[name] == "float | None", name
    for name in GRPO_FIGURES:
        assert step[name] == "float | None" and name not in evals, name
    assert not set(OBJECTIVE_FIGURES) & set(GRPO_FIGURES)
