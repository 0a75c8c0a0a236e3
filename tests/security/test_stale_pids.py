"""No signal reaches a stranger: a recorded pid is signalled only while it is still the run's.

A stale state.json whose pid now belongs to another process (pid reuse, a copied run folder)
used to make `stop` send SIGTERM to that process. Each pid is now recorded with its start time
(`homelab_dp.runs.folder.run_state`); a process with another start time — or, in a state file written
before start times were recorded, one whose command line is not homelab-dp's — is not the run's:
it is never signalled, and the run reads as no longer running.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from homelab_dp.cli import main
from homelab_dp.runs.folder.run_state import (
    alive_pids,
    is_run_process,
    process_start,
    read_state,
    update_state,
)

from ..conftest import DATA

COMPLETED = DATA / "bad_input" / "runs" / "completed-run"


@pytest.fixture
def stranger():
    """An unrelated live process (not homelab-dp's)."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait()


def _running_run(name: str, pids: dict, **extra) -> Path:
    run = Path(os.environ["HOMELAB_DP_RUNS"]) / name
    run.parent.mkdir(parents=True, exist_ok=True)
    shutil.copytree(COMPLETED, run)
    spec = json.loads((run / "spec.json").read_text(encoding="utf-8"))
    spec["run_id"] = name
    (run / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    state = {"status": "running", "run_id": name, "created": 1.0, "attempt": 1,
             "pids": {"keeper": None, "agent": None, "monitor": None, "workers": [], **pids},
             **extra}  # fmt: skip
    (run / "state.json").write_text(json.dumps(state), encoding="utf-8")
    return run


@pytest.mark.parametrize("recorded", ["no start time (an old state file)", "another start time"])
def test_stop_never_signals_a_process_that_reused_a_pid(stranger, recorded, capsys) -> None:
    pid = stranger.pid
    extra = {"starts": {str(pid): process_start(pid) - 1000}} if "another" in recorded else {}
    _running_run("stale-run", {"keeper": pid, "workers": [pid]}, **extra)
    rc = main(["stop", "stale-run", "--timeout", "5"])
    err = capsys.readouterr().err
    assert stranger.poll() is None, "the unrelated process was signalled"
    assert rc == 2, err
    assert err.startswith("error: run stale-run: not running"), err
    assert "hint: " in err and "Traceback" not in err
    assert main(["status", "stale-run", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "failed"  # its processes are gone


def test_a_pid_is_recorded_with_its_start_time_and_checked(tmp_path: Path, stranger) -> None:
    run = tmp_path / "run"
    run.mkdir()
    update_state(run, status="running", pids={"keeper": os.getpid(), "workers": [stranger.pid]})
    state = read_state(run)
    assert state["starts"] == {str(os.getpid()): process_start(os.getpid()),
                               str(stranger.pid): process_start(stranger.pid)}  # fmt: skip
    assert process_start(os.getpid()) > 0
    # Recorded with its start time: the same process is the run's, whatever its command line.
    assert is_run_process(state, stranger.pid, run) and is_run_process(state, os.getpid(), run)
    assert sorted(alive_pids(state, run)) == sorted([os.getpid(), stranger.pid])
    # The same pid with another start time (a reused pid) is not.
    state["starts"][str(stranger.pid)] += 1
    assert not is_run_process(state, stranger.pid, run)
    assert alive_pids(state, run) == [os.getpid()]
    # An old state file (no start times): homelab-dp's command line or the run folder decides.
    del state["starts"]
    assert not is_run_process(state, stranger.pid, run)
    ours = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(run)])
    try:
        deadline = time.monotonic() + 10  # liveness guard: until the child has exec'd
        while b"sleep(60)" not in Path(f"/proc/{ours.pid}/cmdline").read_bytes():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert is_run_process(state, ours.pid, run)
    finally:
        ours.kill()
        ours.wait()
    assert not is_run_process(state, ours.pid, run)  # gone
