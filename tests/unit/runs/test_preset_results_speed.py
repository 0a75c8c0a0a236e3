"""A completed run's record keeps its steady speed (tokens/s, step time, the communication it
waited on) beside what its plan predicted (`homelab_dp.runs.preset_results`)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from homelab_dp.app.plan import make_plan
from homelab_dp.presets.preset_store import open_preset
from homelab_dp.runs.folder.run_folder import create_run_dir
from homelab_dp.runs.folder.run_state import update_state
from homelab_dp.runs.preset_results import (
    predicted_of,
    prediction_error,
    read_results,
    record_run,
    steady_speed,
)
from homelab_dp.runs.run_spec import Launch, Resolved, RunSpec


def step(n: int, tps: float, step_s: float, comm: float | None = None,
         compute: float | None = None, world: int = 2) -> dict[str, Any]:  # fmt: skip
    return {"type": "step", "step": n, "tokens_per_s": tps, "step_time_s": step_s,
            "comm_seconds": comm, "compute_seconds": compute, "world_size": world}  # fmt: skip


def test_steady_speed_leaves_the_first_three_steps_out_and_takes_medians() -> None:
    events = [
        {"type": "start"},
        step(1, 10.0, 9.0, 5.0, 1.0),  # warm-up: allocation, bucket rebuild, optimizer state
        step(2, 20.0, 5.0, 2.0, 3.0),
        step(3, 50.0, 2.0, 0.5, 1.5),
        step(4, 100.0, 1.0, 0.4, 0.8),
        step(5, 120.0, 0.9, 0.3, 0.7),
        step(6, 110.0, 1.1, 0.5, 0.8),
        {"type": "end"},
    ]
    got = steady_speed(events)
    assert got is not None and got["steps"] == 3
    assert got["tokens_per_s"] == 110.0 and got["step_seconds"] == 1.0
    assert got["comm_seconds"] == 0.4 and got["compute_seconds"] == 0.8
    assert got["comm_share"] == pytest.approx(0.2)  # exposed: 1.0 − 0.8 of a 1.0 s step
    # A run shorter than the warm-up: every step counts; one process: nothing communicated.
    short = steady_speed([step(1, 10.0, 2.0, world=1), step(2, 30.0, 1.0, world=1)])
    assert short is not None and short["tokens_per_s"] == 20.0 and short["comm_share"] == 0.0
    assert short["comm_seconds"] is None
    assert steady_speed([{"type": "start"}, {"type": "end"}]) is None


def test_prediction_of_a_plan_and_its_error() -> None:
    assert predicted_of({"method": "full"}) is None  # a plan made before the time model
    plan = {"predicted": {"tokens_per_s": 200.0, "step_seconds": 0.5, "bottleneck": "compute",
                          "assumptions": {"peak": 1}}}  # fmt: skip
    predicted = predicted_of(plan)
    assert predicted is not None and predicted["tokens_per_s"] == 200.0
    assert predicted["bottleneck"] == "compute" and "assumptions" not in predicted
    assert prediction_error({"measured": {"tokens_per_s": 180.0}, "predicted": predicted}) == (
        pytest.approx(-0.1)
    )
    assert prediction_error({"measured": None, "predicted": predicted}) is None


def test_a_completed_run_records_its_steady_speed_beside_its_prediction(in_repo: Path) -> None:
    planned = make_plan(open_preset("tiny-demo"))
    doc = planned.plan.to_json()
    doc["predicted"] = {"tokens_per_s": 400.0, "step_seconds": 0.25, "comm_seconds": 0.05,
                        "exposed_comm_seconds": 0.02, "scaling_efficiency": 0.9}  # fmt: skip
    t = doc["training"]
    resolved = Resolved(doc["method"], doc["distribution"], t["activation_checkpointing"], "cpu",
                        t["world_size"], t["dtype"], t["micro_batch"], t["grad_accum"], 3e-3)  # fmt: skip
    spec = RunSpec("speedy", planned.preset, resolved, Launch(t["world_size"]), plan=doc)
    run_dir = create_run_dir(spec, Path(os.environ["HOMELAB_DP_RUNS"]))  # the test's own
    events = [{"type": "start", "time": 1.0, "world_size": 2, "total_steps": 5}]
    events += [step(n, 300.0 + n, 0.3, 0.06, 0.27) for n in range(1, 6)]
    for e in events[1:]:
        e.update(total_steps=5, loss=1.0, tokens=100 * e["step"], time=1.0 + e["step"])
    events.append({"type": "end", "reason": "completed", "steps": 5, "time": 7.0})
    (run_dir / "events.jsonl").write_text(
        "".join(json.dumps(e) + "\n" for e in events), encoding="utf-8"
    )
    update_state(run_dir, status="running", created=0.5, started=1.0)
    record = record_run(run_dir, {"status": "completed", "reason": "completed", "ended": 7.0})
    assert record is not None
    assert record["measured"]["tokens_per_s"] == 304.5  # steps 4 and 5
    assert record["measured"]["comm_seconds"] == pytest.approx(0.06)
    assert record["measured"]["comm_share"] == pytest.approx(0.1)
    assert record["predicted"]["tokens_per_s"] == 400.0
    assert read_results("tiny-demo")[-1]["measured"] == record["measured"]
