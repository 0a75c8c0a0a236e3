"""The supervisor's last word on real runs (issue 34, item 10): torchrun, gloo, one CPU process,
two steps — kept cheap: the stops end before any training, one run trains to its end.

- The keeper SIGKILLed while the run finishes (stopped first so that the end comes while it
  cannot answer, then killed once the ranks and torchrun have exited): the run is completed,
  its final state is written by the first reader, its notification runs once.
- `stop` right after `run` (0 s: the keeper may not have its handler yet; 1 s: the ranks are
  still starting, their SIGTERM handler not in place): interrupted, stopped by request.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from homelab_dp.app.runs import RunController, make_controller
from homelab_dp.runs.folder.run_state import alive_pids, pid_alive, read_state
from tests.conftest import write_preset
from tests.integration.conftest import events

pytestmark = pytest.mark.slow

LIVENESS_S = 240.0
"""Only ends a hang: a run of this preset takes 10-25 s on 2 loaded cores."""


@pytest.fixture(scope="module")
def controller(tmp_path_factory: pytest.TempPathFactory) -> RunController:
    return make_controller(tmp_path_factory.mktemp("last-word") / "runs")


@pytest.fixture(scope="module")
def preset(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path, data_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("last-word-presets")
    return write_preset(folder, "last-word", tiny_model, data_dir / "ragged-16.jsonl", nproc=1,
                        max_steps=2, checkpoint_every=1, watchdog_s=60)  # fmt: skip


def _until(check, what: str) -> None:
    deadline = time.monotonic() + LIVENESS_S
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_keeper_killed_as_the_run_finishes_leaves_a_completed_run(
    controller: RunController, preset: Path, tmp_path: Path
) -> None:
    notified = tmp_path / "notified"
    command = f'echo "$HOMELAB_DP_RUN_STATE" >> {notified}'
    prepared = controller.prepare(str(preset), force=True)
    run_id = controller.start(prepared, notify=command, force=True)
    run_dir = controller.run_dir(run_id)
    _until(lambda: read_state(run_dir)["pids"].get("agent"), "the agent was never recorded")
    keeper = read_state(run_dir)["pids"]["keeper"]
    os.kill(keeper, signal.SIGSTOP)  # it cannot write the final state now
    try:
        _until(lambda: events(run_dir, "end"), "no end event")
        pids = read_state(run_dir)["pids"]
        ranks = [pids["agent"], *(pids.get("workers") or [])]
        _until(lambda: not any(map(pid_alive, ranks)), "the ranks or torchrun never exited")
    finally:
        os.kill(keeper, signal.SIGKILL)
    # The device monitor leaves once neither its keeper nor the agent is there (~1 s).
    _until(lambda: not alive_pids(read_state(run_dir)), "a process of the run outlived it")
    assert read_state(run_dir)["status"] == "running"  # what the keeper left: no last word
    assert events(run_dir, "end")[-1]["reason"] == "completed" and (run_dir / "final").is_dir()

    doc = controller.status(run_id)
    assert doc["status"] == "completed", doc["reason"]
    assert "its keeper died before writing the final state" in doc["reason"]
    assert read_state(run_dir)["status"] == "completed"
    assert [e["status"] for e in events(run_dir, "state")][-1] == "completed"
    _until(notified.exists, "the notification never ran")
    controller.status(run_id)  # a second reader settles nothing again
    time.sleep(1.0)  # a second notification, were there one, has time to land
    assert notified.read_text().split() == ["completed"]
    assert not alive_pids(read_state(run_dir))


@pytest.mark.parametrize("after_s", [0.0, 1.0])
def test_stop_right_after_the_start_is_interrupted_by_request(
    controller: RunController, preset: Path, after_s: float
) -> None:
    run_id = controller.start(controller.prepare(str(preset), force=True), force=True)
    time.sleep(after_s)
    state = controller.stop(run_id, timeout=LIVENESS_S)
    assert state["status"] == "interrupted", state.get("reason")
    assert state["reason"].startswith("stopped by request"), state["reason"]
    doc = controller.status(run_id)
    assert (doc["status"], doc["reason"]) == ("interrupted", state["reason"])
    assert not alive_pids(read_state(controller.run_dir(run_id)))
