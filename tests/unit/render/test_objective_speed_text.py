"""What a person reads of a preference run and of a run's scaling: the plain log's step and
eval lines, `status`'s lines (from the ``status --json`` document), the live panel and the
Monitor's speed line."""

from __future__ import annotations

import io

from rich.console import Console

from homelab_dp.render.run_view import (
    comm_text,
    eval_line,
    event_line,
    live_panel,
    objective_text,
    prediction_text,
    scaling_text,
    speed_text,
    step_line,
)
from homelab_dp.render.runs import status_lines
from homelab_dp.runs.run_view import RunView

PREDICTED = {"step_seconds": 1.9, "tokens_per_s": 1200.0, "speedup_vs_one_device": 1.85}


def view(world: int = 2, predicted: dict | None = None, **fields: object) -> RunView:
    v = RunView(run_id="r1", world_size=world, predicted=predicted)
    v.apply({"type": "start", "time": 1.0, "total_steps": 10, "world_size": world,
             "objective": fields.pop("objective", "sft")})  # fmt: skip
    for n in range(1, 6):
        v.apply({"type": "step", "time": 1.0 + n, "step": n, "total_steps": 10, "loss": 0.6,
                 "world_size": world, "tokens_per_s": 1000.0, **fields})  # fmt: skip
    return v


def rendered(renderable: object) -> str:
    console = Console(width=240, file=io.StringIO(), color_system=None)
    with console.capture() as out:
        console.print(renderable)
    return out.get()


def test_objective_text_of_dpo_orpo_and_kto() -> None:
    dpo = {"reward_accuracy": 0.875, "reward_margin": 0.5, "rewards_chosen": 0.25,
           "rewards_rejected": -0.25}  # fmt: skip
    assert objective_text(dpo) == (
        "reward accuracy 0.875, margin 0.500 (chosen 0.250, rejected -0.250)"
    )
    assert objective_text({"nll": 1.25, "log_odds_ratio": -0.5}) == "nll 1.2500, log odds -0.500"
    assert objective_text({"rewards_chosen": 0.5, "rewards_rejected": -0.125}) == (
        "rewards chosen 0.500, rejected -0.125"
    )
    assert objective_text(None) is None and objective_text({"loss": 1.0}) is None


def test_scaling_comm_and_prediction_text() -> None:
    scaling = {"world": 2, "speedup": 1.82, "efficiency": 0.91, "comm_share": 0.2,
               "exposed_share": 0.09, "step_time_s": 2.0, "steps": 5}  # fmt: skip
    assert scaling_text(scaling) == "scaling 1.82× of 2 (91%)"
    assert scaling_text(scaling, 1.85) == "scaling 1.82× of 2 (91%), predicted 1.85×"
    assert comm_text(scaling) == "communication 20% of the step, 9% exposed"
    assert comm_text(scaling | {"exposed_share": 0.2}) == "communication 20% of the step"
    assert comm_text(scaling, 0.08) == "communication 20% of the step, 9% exposed (predicted 8%)"
    assert scaling_text(None) is None and comm_text(None) is None
    speed = {"predicted_step_seconds": 1.9, "measured_step_seconds": 2.0,
             "predicted_tokens_per_s": 1200.0, "measured_tokens_per_s": 1000.0}  # fmt: skip
    assert prediction_text(speed) == (
        "step 2.00 s measured, 1.90 s predicted (+5%); "
        "tokens/s 1,000 measured, 1,200 predicted (-17%)"
    )
    assert prediction_text({"predicted_step_seconds": 1.9, "measured_step_seconds": None}) == (
        "step 1.90 s predicted, not measured yet"
    )
    assert prediction_text(None) is None


def test_a_dpo_step_line_has_rewards_and_scaling() -> None:
    v = view(objective="dpo", reward_accuracy=0.75, reward_margin=0.25, step_time_s=2.0,
             compute_seconds=1.8, comm_seconds=0.4)  # fmt: skip
    line = step_line(v)
    assert line.endswith("| reward accuracy 0.750, margin 0.250 | scaling 1.80× of 2 (90%)")


def test_an_sft_step_line_on_one_process_is_as_before() -> None:
    line = step_line(view(world=1, step_time_s=1.0))
    assert "reward" not in line and "scaling" not in line and line.endswith("=0")


def test_a_preference_eval_line_names_pairs_and_rewards_not_perplexity() -> None:
    e = {"type": "eval", "step": 20, "loss": 0.55, "perplexity": 1.73, "tokens": 900,
         "pairs": 16, "reward_accuracy": 0.75, "reward_margin": 0.3, "best": True}  # fmt: skip
    assert eval_line(e) == (
        "eval step 20: loss 0.5500, 16 pairs, reward accuracy 0.750, margin 0.300 (best so far)"
    )
    sft = {"type": "eval", "step": 20, "loss": 2.31, "perplexity": 10.07, "tokens": 5120}
    assert eval_line(sft) == "eval step 20: loss 2.3100, ppl 10.1, 5,120 tokens"


def test_status_lines_show_scaling_prediction_and_rewards() -> None:
    doc = {"run_id": "r1", "status": "running", "method": "lora", "distribution": "ddp",
           "world_size": 2, "step": 5, "total_steps": 10, "loss": 0.6, "tokens_per_s": 1000.0,
           "objective": "dpo",
           "objective_figures": {"reward_accuracy": 0.75, "reward_margin": 0.25},
           "scaling": {"world": 2, "speedup": 1.8, "efficiency": 0.9, "comm_share": 0.2,
                       "exposed_share": 0.1, "step_time_s": 2.0, "steps": 5},
           "speed": {"predicted_step_seconds": 1.9, "measured_step_seconds": 2.0,
                     "predicted_speedup": 1.85}}  # fmt: skip
    lines = status_lines(doc)
    assert "scaling   1.80× of 2 (90%), predicted 1.85×; communication 20% of the step, " \
           "10% exposed" in lines  # fmt: skip
    assert "predicted step 2.00 s measured, 1.90 s predicted (+5%)" in lines
    assert "objective dpo · reward accuracy 0.750, margin 0.250" in lines
    old = {k: v for k, v in doc.items() if k not in ("objective_figures", "scaling", "speed")}
    assert not any(line.split()[0] in ("scaling", "predicted", "objective")
                   for line in status_lines(old))  # fmt: skip


def test_the_live_panel_and_the_monitor_line() -> None:
    v = view(objective="orpo", predicted=PREDICTED, nll=1.25, log_odds_ratio=0.5,
             step_time_s=2.0, compute_seconds=1.8, comm_seconds=0.4)  # fmt: skip
    panel = rendered(live_panel(v))
    assert "nll 1.2500, log odds 0.500" in panel
    assert "scaling 1.80× of 2 (90%), predicted 1.85× · communication 20% of the step, " \
           "10% exposed · step 2.00 s measured, 1.90 s predicted (+5%)" in panel  # fmt: skip
    assert speed_text(v).plain == (
        "scaling 1.80× of 2 (90%), predicted 1.85× · communication 20% of the step, 10% exposed"
        " (median of 5 steps)\nstep 2.00 s measured, 1.90 s predicted (+5%); tokens/s 1,000 "
        "measured, 1,200 predicted (-17%)"
    )
    one = view(world=1, predicted=PREDICTED, step_time_s=1.5)
    assert speed_text(one).plain.startswith("step 1.50 s measured, 1.90 s predicted (-21%)")
    assert speed_text(view(world=1)).plain == ""


def test_the_start_line_names_a_preference_objective_and_its_reference() -> None:
    v = RunView(run_id="r1", method="lora", distribution="ddp", world_size=2, total_steps=10)
    start = {"type": "start", "objective": "dpo", "reference": "adapters"}
    assert event_line(start, v) == (
        "started r1: lora · dpo (reference: adapters) · ddp, 2 process(es), 10 steps"
    )
    assert event_line({"type": "start", "objective": "sft"}, v) == (
        "started r1: lora · ddp, 2 process(es), 10 steps"
    )
