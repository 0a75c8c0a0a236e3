"""Graceful stop by signal, the worker's refusal to run outside a launcher, the torchrun command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from homelab_dp.runs.run_spec import Rendezvous
from homelab_dp.supervise.launcher import launch, torchrun_command
from homelab_dp.train.loop.checkpoints import check_checkpoint
from tests.integration.conftest import events, make_run


def _wait_for_step(rd: Path, step: int, proc: subprocess.Popen, timeout: float = 180) -> None:
    """``timeout`` is a liveness guard: a run's first step comes 8-18 s after its start on 2 cores
    (`python benchmarks/run_e2e.py`, its first-step row)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if any(e["step"] >= step for e in events(rd, "step")):
            return
        assert proc.poll() is None, (rd / "logs" / "launcher.log").read_text()[-4000:]
        time.sleep(0.1)
    raise AssertionError(f"no step {step} within {timeout} s")


@pytest.mark.slow
@pytest.mark.parametrize("target", ["one-worker", "agent"])
def test_sigterm_stops_gracefully(target: str, tiny_model: Path, data_dir: Path, tmp_path: Path):
    """SIGTERM to one rank (how the controller stops a run) or to the torchrun agent (which
    forwards it to every worker): the ranks agree at a step boundary, checkpoint, end "stopped"."""
    rd = make_run(
        tmp_path, tiny_model, data_dir / "ragged-64.jsonl", name="sig", train={"max_steps": 2000}
    )
    proc = launch(rd)
    try:
        _wait_for_step(rd, 2, proc)
        if target == "agent":
            proc.send_signal(signal.SIGTERM)
        else:
            os.kill(events(rd, "start")[0]["pids"][1], signal.SIGTERM)
        rc = proc.wait(timeout=60)  # liveness guard: a graceful stop takes ~3 s (run_e2e.py)
    finally:
        if proc.poll() is None:
            proc.kill()
    end = events(rd, "end")[-1]
    assert end["reason"] == "stopped" and 2 <= end["steps"] < 2000
    assert check_checkpoint(rd / "checkpoints" / f"step-{end['steps']}") is None
    assert events(rd, "checkpoint")[-1]["step"] == end["steps"]
    if target == "one-worker":
        assert rc == 0  # every worker exited 0, so torchrun did too
    else:
        assert rc != 0  # torchrun reports its own SIGTERM as a failure; the end event tells


def test_worker_refuses_to_run_without_a_launcher(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "homelab_dp.train.loop.worker", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert lines[0].startswith("error: the worker runs under torchrun")
    assert lines[1].startswith("hint: ")


def test_torchrun_command_single_node_is_loopback(tmp_path: Path) -> None:
    cmd = torchrun_command(tmp_path / "run-1", 2)
    assert cmd[:3] == [
        sys.executable,
        "-m",
        "homelab_dp.supervise.torchrun_agent",
    ]  # torchrun, stores on loopback
    assert "--rdzv-backend=c10d" in cmd and "--max-restarts=0" in cmd
    endpoint = next(a for a in cmd if a.startswith("--rdzv-endpoint="))
    assert endpoint.startswith("--rdzv-endpoint=127.0.0.1:")
    assert cmd[cmd.index("--log-dir") + 1] == str(tmp_path / "run-1" / "logs")
    assert cmd[-3:] == ["-m", "homelab_dp.train.loop.worker", str(tmp_path / "run-1")]
    rdzv = Rendezvous(nnodes=2, node_rank=1, master_addr="10.0.0.2", master_port=29500)
    multi = torchrun_command(tmp_path / "r", 4, rdzv, resume=True)
    assert "--rdzv-endpoint=10.0.0.2:29500" in multi and "--node-rank=1" in multi
    assert multi[-1] == "--resume"
