"""The figures new in step and eval events reach every logger (`train.loop.reporting`): a DPO/KTO run's
rewards, an ORPO run's nll and log odds, each step's measured communication and compute
seconds; a field that is None (another objective, one process) is left out, never logged as 0."""

from __future__ import annotations

import pytest

from homelab_dp.runs.run_events import EvalEvent, StepEvent
from homelab_dp.train.loop.reporting import eval_scalars, step_scalars

DPO = {"rewards_chosen": 0.25, "rewards_rejected": -0.5, "reward_margin": 0.75,
       "reward_accuracy": 0.875}  # fmt: skip
ORPO = {"nll": 1.5, "log_odds_ratio": -0.625}


def test_a_dpo_steps_rewards_and_timing_are_scalars() -> None:
    event = StepEvent(step=3, loss=0.6, comm_seconds=0.125, compute_seconds=0.5, **DPO)
    out = step_scalars(event)
    assert {k: out[f"train/{k}"] for k in DPO} == DPO
    assert out["train/comm_seconds"] == 0.125 and out["train/compute_seconds"] == 0.5
    assert not any(k in out for k in ("train/nll", "train/log_odds_ratio"))


def test_an_orpo_step_has_nll_and_log_odds_and_no_rewards() -> None:
    out = step_scalars(StepEvent(step=1, loss=1.2, **ORPO))
    assert (out["train/nll"], out["train/log_odds_ratio"]) == (1.5, -0.625)
    assert not any("reward" in k for k in out)
    # one process: no communication was measured, so there is no curve for it
    assert "train/comm_seconds" not in out and "train/compute_seconds" not in out


@pytest.mark.parametrize("fields", [DPO, ORPO])
def test_eval_events_carry_the_same_figures(fields: dict[str, float]) -> None:
    out = eval_scalars(EvalEvent(step=10, loss=0.5, perplexity=1.6, pairs=32, **fields))
    assert {k: out[f"eval/{k}"] for k in fields} == fields
    assert out["eval/loss"] == 0.5


def test_an_sft_step_logs_no_preference_figures() -> None:
    out = step_scalars(StepEvent(step=1, loss=2.0, lr=1e-3))
    assert set(out) == {"train/loss", "train/lr", "train/epoch"}
