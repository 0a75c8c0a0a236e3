"""Runs found from anywhere, through the real console script: a run started in one folder is
listed, inspected, stopped and resumed by id (or a prefix) from another, with HOMELAB_DP_RUNS
unset (the per-user default root and the per-user run index)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from homelab_dp.runs.folder.run_state import alive_pids, read_state
from homelab_dp.train.loop.rank_guard import FAULT_ENV
from tests.conftest import DATA, write_preset
from tests.integration.conftest import held_workers

EXE = Path(sys.executable).with_name("homelab-dp")
pytestmark = pytest.mark.slow
RECORDED = DATA / "events" / "20250301-101500-smollm2-135m-lora-7f3a"


def cli(env: dict[str, str], cwd: Path, *args: str, timeout: float = 240):
    """`homelab-dp ARGS` run from ``cwd``."""
    return subprocess.run([str(EXE), *args], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def status(env: dict[str, str], cwd: Path, ref: str) -> dict:
    out = cli(env, cwd, "status", ref, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """No HOMELAB_DP_RUNS: runs go to the per-user root under this test's XDG_DATA_HOME."""
    out = {k: v for k, v in os.environ.items() if k != "HOMELAB_DP_RUNS"}
    out["XDG_DATA_HOME"] = str(tmp_path / "xdg-data")
    return out


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    """Two unrelated working folders: A, where runs start, and B, where they are looked at."""
    a, b = tmp_path / "project-a", tmp_path / "home-b"
    a.mkdir()
    b.mkdir()
    return a, b


def test_started_in_one_folder_stopped_and_resumed_from_another(
    env: dict[str, str], folders: tuple[Path, Path], tiny_model: Path, data_dir: Path,
    tmp_path: Path,
) -> None:  # fmt: skip
    a, b = folders
    data = data_dir / "ragged-64.jsonl"
    preset = write_preset(
        tmp_path, "p-4", tiny_model, data, seq_len=64, pack=True, nproc=1, max_steps=4
    )
    # The rank holds still at the start of step 2 until the stop request is pending on it, so
    # `stop` finds the run going instead of racing it (as in test_controller).
    hold = {**env, FAULT_ENV: "sigstop:rank=0:step=2"}
    started = cli(hold, a, "run", str(preset), "--detach", "--json", "--force")
    assert started.returncode == 0, started.stderr
    run_id = json.loads(started.stdout.strip().splitlines()[-1])["run_id"]
    root = tmp_path / "xdg-data" / "homelab-dp" / "runs"
    assert (root / run_id / "spec.json").is_file()  # the per-user root, not A/runs
    assert not (a / "runs").exists()

    listed = json.loads(cli(env, b, "runs", "--json").stdout)
    assert [(r["run_id"], r["path"], r["exists"]) for r in listed] == [
        (run_id, str((root / run_id).resolve()), True)
    ]
    table = cli(env, b, "runs").stdout.splitlines()
    assert table[0].split()[-1] == "folder"
    assert table[1].startswith(run_id) and table[1].split()[-1] == str(root.resolve())
    assert status(env, b, run_id[:-3])["run_id"] == run_id  # a unique prefix, from B

    [worker] = held_workers(root / run_id, 1)
    try:
        stopping = subprocess.Popen([str(EXE), "stop", run_id], env=env, cwd=b, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
        _wait_until_pending(worker, signal.SIGTERM, stopping)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)
    _, err = stopping.communicate(timeout=240)
    assert stopping.returncode == 0, err
    stopped = status(env, b, run_id)
    assert stopped["status"] == "interrupted" and stopped["step"] < 4

    resumed = cli(env, b, "resume", run_id, "--json", timeout=400)  # follows it to the end
    assert resumed.returncode == 0, resumed.stderr
    steps = [e["step"] for e in map(json.loads, resumed.stdout.splitlines()) if e["type"] == "step"]
    assert steps and steps[-1] == 4
    done = status(env, b, run_id)
    assert (done["status"], done["step"], done["attempt"]) == ("completed", 4, 2)
    assert not alive_pids(read_state(root / run_id))


def test_a_run_in_a_runs_folder_is_found_by_id_until_its_folder_goes(
    env: dict[str, str], folders: tuple[Path, Path], tmp_path: Path
) -> None:
    """A completed run kept in its own folder (the recorded one: no training needed here)."""
    a, b = folders
    kept = tmp_path / "kept-runs"
    shutil.copytree(RECORDED, kept / RECORDED.name)
    run_id, run_dir = RECORDED.name, (kept / RECORDED.name).resolve()
    listed = json.loads(cli(env, a, "runs", "--runs", str(kept), "--json").stdout)
    assert [(r["run_id"], r["path"], r["status"]) for r in listed] == [
        (run_id, str(run_dir), "completed")
    ]

    # From B, without --runs: the per-user index knows where it is.
    doc = status(env, b, run_id[:15])
    assert (doc["run_id"], doc["status"], doc["path"]) == (run_id, "completed", str(run_dir))

    # Two runs that share a prefix: the prefix is refused, naming them.
    shutil.copytree(run_dir, kept / (run_id[:-4] + "ffff"))
    out = cli(env, b, "status", run_id[:-4], "--runs", str(kept))
    assert out.returncode == 2 and "matches 2 runs" in out.stderr and "hint:" in out.stderr
    assert run_id in out.stderr

    # The folder goes: `runs` says so, `status` explains, neither crashes.
    shutil.rmtree(run_dir)
    rows = {r["run_id"]: r for r in json.loads(cli(env, b, "runs", "--json").stdout)}
    assert rows[run_id]["exists"] is False and rows[run_id]["status"] is None
    table = cli(env, b, "runs").stdout.splitlines()
    assert [line.split() for line in table if line.startswith(run_id)] == [
        [run_id, "gone", str(kept.resolve())]
    ]
    out = cli(env, b, "status", run_id)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"error: run {run_id} was at {run_dir}; that folder is gone" in out.stderr

    forgot = cli(env, b, "runs", "--forget-gone", "--json")
    assert json.loads(forgot.stdout) == {"forgotten": [run_id]}
    assert run_id not in cli(env, b, "runs", "--json").stdout
    assert "no such run" in cli(env, b, "status", run_id).stderr


def test_a_runs_folder_that_cannot_be_created_starts_nothing(
    env: dict[str, str], folders: tuple[Path, Path], tmp_path: Path
) -> None:
    a, _ = folders
    (tmp_path / "a-file").write_text("", encoding="utf-8")
    for args in (["run", "tiny-demo", "--detach"], ["runs"], ["status", "x"]):
        out = cli(env, a, *args, "--runs", str(tmp_path / "a-file" / "runs"), timeout=60)
        assert out.returncode == 2, out.stderr
        assert f"error: --runs {tmp_path / 'a-file' / 'runs'}: cannot create" in out.stderr
        assert "hint:" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "xdg-data").exists()  # no run folder, no index line


def _wait_until_pending(
    pid: int, sig: signal.Signals, sender: subprocess.Popen, timeout: float = 60
) -> None:
    """Until ``sig`` is pending on the (stopped) process. ``timeout``: a liveness guard."""
    bit = 1 << (sig - 1)
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert sender.poll() is None, sender.communicate()
        fields = dict(
            line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
        )
        if (int(fields["SigPnd"], 16) | int(fields["ShdPnd"], 16)) & bit:
            return
        time.sleep(0.05)
    raise AssertionError(f"{sig.name} not pending on {pid} within {timeout} s")
