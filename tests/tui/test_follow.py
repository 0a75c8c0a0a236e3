"""Following under load: coalescing updates, a responsive UI, and runs that outlive the TUI."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from homelab_dp.app.follow import LogTail, RunPoller, Snapshot, copy_view
from homelab_dp.app.runs import RunController
from homelab_dp.runs.folder.jsonl_tail import read_all
from homelab_dp.runs.folder.run_state import pid_alive, read_state
from homelab_dp.runs.run_view import RunView
from homelab_dp.tui.messages import RunUpdated
from tests.tui.conftest import RECORDED, RUN_ID, copy_run, open_monitor, set_state, wait_for
from tests.tui.flood import KEY_LIVENESS_S, SWITCHES, key_latency, thousand_events, write_slowly


def _snapshot(run_id: str, step: int) -> Snapshot:
    return Snapshot(run_id, RunView(run_id=run_id, step=step), (), 0, ())


def test_a_newer_update_of_the_same_run_replaces_a_pending_one() -> None:
    old, new = RunUpdated(_snapshot("a", 1)), RunUpdated(_snapshot("a", 2))
    assert old.can_replace(new)
    assert not old.can_replace(RunUpdated(_snapshot("b", 2)))  # another run's update stays


def test_a_snapshot_shares_nothing_mutable_with_the_live_view(controller: RunController) -> None:
    view = controller.view(RUN_ID)
    copy = copy_view(view)
    view.apply({"type": "step", "step": 41, "loss": 0.5, "rank_step_times_s": [1.0, 1.0]})
    view.apply({"type": "devices", "devices": [{"key": "gpu0", "temperature_c": 99}]})
    assert copy.step == 40 and len(copy.losses) == 40
    assert copy.devices["gpu0"].temperature_c != 99 and copy.stragglers


async def test_a_burst_of_updates_is_coalesced(controller: RunController) -> None:
    async with open_monitor(controller, RUN_ID) as (app, pilot, _):
        app.workers.cancel_group(app, "follow")  # only our updates from now on
        handled_before = app.updates_handled
        posted = 1000

        def burst() -> None:
            for step in range(1, posted + 1):
                app.post_message(RunUpdated(_snapshot(RUN_ID, step)))

        thread = threading.Thread(target=burst)
        thread.start()
        thread.join()
        await wait_for(pilot, lambda: app.snapshot.view.step == posted, what="the last update")
        handled = app.updates_handled - handled_before
        assert handled < posted / 2  # most were replaced while pending
        assert app.screen.shown.view.step == posted  # the newest one is what is on screen


async def test_every_event_is_folded_and_every_key_answered_while_1000_events_arrive(
    runs_root: Path,
) -> None:
    """1000 events written at ~500 a second: every one is folded, updates are coalesced, and
    every key is answered meanwhile.

    How fast keys are answered is a figure, not a pass mark: `python benchmarks/tui_latency.py`
    prints it (median, p95, max), idle and under this same flood. Here a key only has to be
    answered at all: `KEY_LIVENESS_S` is a liveness guard, twice the slowest press measured at
    load average 17 on 2 cores (docs/benchmarks.md). (A 0.5 s bound used to stand here; a loaded
    2-core CI machine measured 0.75-0.80 s.)
    """
    run_dir = copy_run(runs_root, "20250301-141500-fast-0003", status="running", events=False,
                       pids={"keeper": os.getpid()})  # fmt: skip
    events = thousand_events(run_dir.name)
    controller = RunController(runs_root)
    async with open_monitor(controller, run_dir.name, follow_interval=0.01) as (app, pilot, _):
        writer = threading.Thread(target=write_slowly, args=(run_dir / "events.jsonl", events))
        writer.start()
        latencies = []
        while writer.is_alive():
            for key, mode in SWITCHES:
                latencies.append(await key_latency(app, key, mode))
        writer.join()
        await wait_for(pilot, lambda: app.snapshot.view.step == 998, what="the last step")
        view = app.snapshot.view
        steps = [e for e in events if e["type"] == "step"]
        assert view.loss == steps[-1]["loss"] and len(view.losses) == len(steps)
        assert view.micro_step == 0 and view.events_seen >= len(events)
        assert max(latencies) < KEY_LIVENESS_S, latencies  # liveness guard, not a latency target
        assert app.updates_handled < len(events)


def test_the_follower_reads_every_event_once(runs_root: Path) -> None:
    follower = RunPoller(RunController(runs_root), RUN_ID)
    snapshot = follower.poll()
    assert snapshot is not None
    assert follower.events_read == sum(
        1 for name in ("events.jsonl", "devices.jsonl") for _ in read_all(RECORDED / name)
    )
    assert follower.poll() is None  # nothing new, nothing posted


async def test_quitting_the_tui_leaves_the_run_going(runs_root: Path) -> None:
    run_dir = copy_run(runs_root, "20250301-151500-long-0004", status="running")
    worker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        set_state(run_dir, status="running", pids={"keeper": worker.pid, "workers": [worker.pid]})
        stops: list[str] = []

        class NoStop(RunController):
            def stop(self, run_id: str, timeout: float = 1.0) -> dict[str, Any]:
                stops.append(run_id)
                return {}

        async with open_monitor(NoStop(runs_root), run_dir.name) as (_, pilot, _):
            await pilot.press("q")
        assert stops == []
        assert pid_alive(worker.pid)
        assert read_state(run_dir)["status"] == "running"
    finally:
        worker.kill()
        worker.wait()


def test_the_log_tail_keeps_whole_lines_and_skips_torchruns_copies(tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    rank = logs / "run_x" / "attempt_0" / "1"
    rank.mkdir(parents=True)
    (rank / "stderr.log").write_text("[rank1] a line launcher.log has too\n")
    (logs / "launcher.log").write_text("[default0]:Loading 0%\r[default0]:Loading 100%\n[def")
    (logs / "keeper.log").write_text("keeper started\n")
    tail = LogTail(logs)
    assert tail.read() == 2
    assert list(tail.lines) == ["keeper: keeper started", "launcher: [default0]:Loading 100%"]
    with open(logs / "launcher.log", "a") as fh:
        fh.write("ault1]:step 1\n")  # the rest of the half-written line
    assert tail.read() == 1 and tail.lines[-1] == "launcher: [default1]:step 1"
    assert tail.seq == 3 and tail.files == ("keeper", "launcher")
