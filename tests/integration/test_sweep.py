"""A real 2×2 sweep of the tiny demo (2 steps, 1 CPU process each, eval on a held-out tenth):
the four runs complete one after another in the order they were queued, `runs compare --json`
ranks them by eval loss, and `--notify` ran its command once per ended run with the state in
its environment — also for a run stopped while queued (interrupted, nothing started)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from homelab_dp.runs.folder.run_state import read_state
from homelab_dp.vocabulary import FINAL_STATUSES
from tests.conftest import run_cli

pytestmark = pytest.mark.slow
GUARD_S = 900.0
"""Liveness guard for the whole sweep (about 90 s on CI)."""


def wait_final(run_dir: Path, deadline: float) -> dict:
    while (state := read_state(run_dir)).get("status") not in FINAL_STATUSES:
        assert time.time() < deadline, state
        time.sleep(0.3)
    return state


@pytest.mark.timeout(GUARD_S + 60)  # five runs one after another: past pytest's default 300 s
def test_a_2x2_sweep_runs_in_order_ranks_by_eval_loss_and_notifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    notified = tmp_path / "notified.txt"
    notify = f'echo "$HOMELAB_DP_RUN_ID $HOMELAB_DP_RUN_STATE" >> {notified}'
    sets = ["train.max_steps=2", "train.warmup_steps=0", "train.method=lora",
            "hardware.nproc=1", "data.eval_fraction=0.1", "train.checkpoint_every=0"]  # fmt: skip
    rc, out, err = run_cli(
        capsys, "sweep", "tiny-demo", "--gpus", "cpu:1",
        *(a for s in sets for a in ("--set", s)),
        "--grid", "train.lr=1e-5,3e-3", "--grid", "lora.r=4,8", "--notify", notify, "--json",
    )  # fmt: skip
    assert rc == 0, err
    sweep = json.loads(out)
    points = sweep["points"]
    assert [p["settings"] for p in points] == [
        {"train.lr": 1e-5, "lora.r": 4}, {"train.lr": 1e-5, "lora.r": 8},
        {"train.lr": 3e-3, "lora.r": 4}, {"train.lr": 3e-3, "lora.r": 8},
    ]  # fmt: skip
    assert all(p["fits"] and p["run_id"] for p in points)
    # A fifth run queued behind them and stopped there: it ends (interrupted) and notifies.
    rc, out, err = run_cli(capsys, "run", "tiny-demo", "--gpus", "cpu:1", "--queue",
                           "--detach", "--json", "--notify", notify, "--set", "hardware.nproc=1")  # fmt: skip
    assert rc == 0, err
    extra = json.loads(out.strip().splitlines()[-1])["run_id"]
    rc, _, err = run_cli(capsys, "stop", extra)
    assert rc == 0, err

    runs = Path(os.environ["HOMELAB_DP_RUNS"])
    deadline = time.time() + GUARD_S
    states = [wait_final(runs / p["run_id"], deadline) for p in points]
    assert [s["status"] for s in states] == ["completed"] * 4, states
    # In queue order: each started after the one before it ended.
    for before, after in zip(states, states[1:], strict=False):
        assert before["ended"] <= after["started"], (before, after)
    assert wait_final(runs / extra, deadline)["status"] == "interrupted"

    rc, out, err = run_cli(capsys, "runs", "--sweep", sweep["sweep_id"], "--json")
    assert rc == 0 and sorted(r["run_id"] for r in json.loads(out)) == sorted(
        p["run_id"] for p in points
    )
    rc, out, err = run_cli(capsys, "runs", "compare", "--sweep", sweep["sweep_id"], "--json")
    assert rc == 0, err
    doc = json.loads(out)
    losses = [r["eval_loss"] for r in doc["runs"]]
    assert all(loss is not None for loss in losses) and losses == sorted(losses)
    assert doc["differ"] == ["lora.r", "train.lr"]
    assert len(set(losses)) > 1  # the learning rates make a difference the ranking shows
    assert doc["runs"][0]["settings"]["train.lr"] == 3e-3

    # The keepers notify after the final state: give the last ones a moment (liveness guard).
    want = sorted([f"{p['run_id']} completed" for p in points] + [f"{extra} interrupted"])
    while sorted(notified.read_text().splitlines() if notified.exists() else []) != want:
        assert time.time() < deadline, notified.read_text() if notified.exists() else None
        time.sleep(0.3)
