"""The queue for the cards, through the real console script: one CPU run holding the CPU host,
a start without --queue refused, two queued runs that start in order after it; a queued run
whose keeper died, resumed into the queue again and stopped there (no run started).

The first run's rank holds still at step 2 (an injected SIGSTOP, `homelab_dp.train.loop.rank_guard`) while
the others are queued and inspected, so nothing races the run; it goes on once they are.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from homelab_dp.app.plan import make_plan, on_idle_cards
from homelab_dp.app.runs import make_controller
from homelab_dp.errors import HomelabError
from homelab_dp.presets.preset_store import open_preset
from homelab_dp.runs.folder.run_state import (
    FINAL,
    alive_pids,
    current_state,
    read_state,
    update_state,
)
from homelab_dp.runs.run_queue import Devices, Other, free_memory, waiting
from homelab_dp.train.loop.rank_guard import FAULT_ENV
from tests.conftest import write_preset
from tests.integration.conftest import held_workers, make_run

EXE = Path(sys.executable).with_name("homelab-dp")
pytestmark = pytest.mark.slow


def cli(env: dict[str, str], *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(EXE), *args], env=env, capture_output=True, text=True, timeout=timeout, check=False
    )


def status(env: dict[str, str], run_id: str) -> dict:
    out = cli(env, "status", run_id, "--json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def detached(env: dict[str, str], preset: Path, *extra: str) -> str:
    out = cli(env, "run", str(preset), "--gpus", "cpu:1", "--detach", "--json", *extra)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])["run_id"]


def wait_ended(run_dir: Path, timeout: float = 240) -> dict:
    """Until the run has ended, then its `status --json` document (read here: a CLI call a
    second would compete with the runs for the 2 cores). ``timeout`` is a liveness guard: each
    run takes ~10 s."""
    deadline = time.time() + timeout
    while current_state(run_dir).get("status") not in FINAL and time.time() < deadline:
        time.sleep(0.3)
    return make_controller(run_dir.parent).status(run_dir.name)


def test_queued_runs_start_in_order_after_the_running_one(
    tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    runs = tmp_path / "runs"
    env = {**os.environ, "HOMELAB_DP_RUNS": str(runs)}
    data = data_dir / "ragged-64.jsonl"
    preset = write_preset(
        tmp_path, "q", tiny_model, data, seq_len=64, pack=True, nproc=1, max_steps=4, grad_accum=1
    )
    first = detached({**env, FAULT_ENV: "sigstop:rank=0:step=2"}, preset)
    [worker] = held_workers(runs / first, 1, timeout=120)  # its first step: 8-18 s after start
    try:
        # Without --queue: refused, nothing created.
        before = sorted(p.name for p in runs.iterdir())
        out = cli(env, "run", str(preset), "--gpus", "cpu:1", "--detach")
        assert out.returncode == 2, out.stderr
        assert f"error: the CPU host is in use by run {first} (running)" in out.stderr
        assert "hint: add --queue to start it when they are free, or --force" in out.stderr
        assert sorted(p.name for p in runs.iterdir()) == before
        # --queue with a what-if size spec: nothing to wait for.
        out = cli(env, "run", str(preset), "--queue", "--gpus", "2x24GiB")
        assert out.returncode == 2 and "error: --queue with --gpus 2x24GiB" in out.stderr
        assert "hint:" in out.stderr and sorted(p.name for p in runs.iterdir()) == before

        second = detached(env, preset, "--queue")
        third = detached(env, preset, "--queue")
        docs = {r: status(env, r) for r in (second, third)}
        assert [docs[r]["status"] for r in docs] == ["queued"] * 2
        assert docs[second]["queue"] == {"position": 1, "waiting_for": [first]}
        assert docs[third]["queue"] == {"position": 2, "waiting_for": [first, second]}
        table = cli(env, "runs").stdout
        assert f"{third:<44} queued #2" in table
        text = cli(env, "status", third).stdout
        assert f"position 2 in the queue, waiting for {first}, {second}" in text
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGCONT)

    ended = [wait_ended(runs / r) for r in (first, second, third)]
    assert [d["status"] for d in ended] == ["completed"] * 3, [d["reason"] for d in ended]
    states = [read_state(runs / r) for r in (first, second, third)]
    # Each queued run started only after the one before it ended.
    assert states[1]["started"] >= states[0]["ended"]
    assert states[2]["started"] >= states[1]["ended"]
    assert [d["step"] for d in ended] == [4, 4, 4]


def test_a_queued_run_whose_keeper_died_reads_interrupted_and_resume_queues_it_again(
    tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    """No run is started: "busy" holds the CPU host (this test's process stands for its keeper)."""
    root = tmp_path / "runs"
    controller = make_controller(root)
    data = data_dir / "ragged-16.jsonl"
    busy = make_run(root, tiny_model, data, name="busy", world=1)
    update_state(busy, status="running", created=time.time() - 60, pids={"keeper": os.getpid()})
    lost = make_run(root, tiny_model, data, name="lost", world=1)
    gone = subprocess.Popen(["true"])
    gone.wait()
    update_state(lost, status="queued", created=time.time(), pids={"keeper": gone.pid})

    doc = controller.status("lost")  # a reboot: the keeper is gone, nothing had started
    assert doc["status"] == "interrupted" and doc["queue"] is None
    assert "nothing was started" in doc["reason"] and "resume lost" in doc["reason"]

    controller.resume("lost")
    assert controller.status("lost")["queue"] == {"position": 1, "waiting_for": ["busy"]}
    deadline = time.time() + 60  # liveness guard: the keeper records its wait within ~1 s
    while not read_state(lost).get("queue") and time.time() < deadline:
        time.sleep(0.1)
    assert read_state(lost)["queue"] == {"position": 1, "waiting_for": ["busy"]}
    out = cli({**os.environ, "HOMELAB_DP_RUNS": str(root)}, "stop", "lost")
    assert out.returncode == 0, out.stderr
    assert "lost: interrupted — stopped while queued; nothing was started" in out.stdout
    state = read_state(lost)
    assert state["status"] == "interrupted" and not alive_pids(state)
    assert not (lost / "logs" / "launcher.log").exists()  # no worker was ever launched
    # Queued again: the stop of its earlier turn (a mark in state.json) does not stop this one.
    controller.resume("lost")
    while read_state(lost).get("queue") is None and time.time() < deadline:
        time.sleep(0.1)
    assert read_state(lost)["status"] == "queued", read_state(lost)
    assert controller.stop("lost", timeout=60)["status"] == "interrupted"

    # A run stopped after it had started resumes only when its devices are free, or queued.
    paused = make_run(root, tiny_model, data, name="paused", world=1)
    update_state(paused, status="interrupted", created=time.time(), pids={"keeper": gone.pid})
    with pytest.raises(HomelabError, match="the CPU host is in use by run busy") as refused:
        controller.resume("paused")
    assert "--queue" in refused.value.hint and read_state(paused)["status"] == "interrupted"
    controller.resume("paused", queue=True)
    assert controller.status("paused")["queue"] == {"position": 1, "waiting_for": ["busy"]}
    while not read_state(paused).get("queue") and time.time() < deadline:
        time.sleep(0.1)
    assert controller.stop("paused", timeout=60)["status"] == "interrupted"


def test_the_waiting_rule() -> None:
    """Cards overlap by UUID when both runs know them, else by index; FIFO; memory last."""
    gpus01 = Devices(False, (0, 1), ("GPU-a", "GPU-b"))
    others = [
        Other("uses-1", "running", 1.0, Devices(False, (1,), ("GPU-b",))),
        Other("other-card", "running", 2.0, Devices(False, (2,), ("GPU-c",))),
        Other("cpu", "running", 3.0, Devices(cpu=True)),
        Other("queued-before", "queued", 4.0, Devices(False, (0,))),
        Other("queued-after", "queued", 9.0, Devices(False, (0,))),
        Other("done", "completed", 0.5, Devices(False, (0, 1))),
    ]
    w = waiting("me", 5.0, gpus01, others)
    assert w.to_json() == {"position": 2, "waiting_for": ["uses-1", "queued-before"]}
    free = {0: 30 << 30, 1: 10 << 30}
    alone = waiting("me", 5.0, gpus01, others[1:3], free, need_bytes=20 << 30)
    assert alone.to_json() == {"position": 1, "waiting_for": ["memory on GPU 1"]}
    assert not waiting("me", 5.0, gpus01, others[1:3], free, need_bytes=8 << 30).waiting_for
    assert waiting("me", 5.0, Devices(cpu=True), others).waiting_for == ("cpu",)
    assert gpus01.shared(others[0].devices) == "GPU 1"


def test_free_memory_reads_the_cards(monkeypatch: pytest.MonkeyPatch) -> None:
    """The keeper's memory probe: free bytes per card index from NVML (here a recording)."""
    recording = Path(__file__).parents[1] / "data" / "nvml" / "2x3090-nvlink.json"
    monkeypatch.setenv("HOMELAB_DP_FAKE_NVML", str(recording))
    assert free_memory([1, 0, 7]) == {1: 25499271168, 0: 25220546560, 7: None}
    busy = waiting("me", 1.0, Devices(False, (0, 1)), [], free_memory([0, 1]), 25_300_000_000)
    assert busy.waiting_for == ("memory on GPU 0",)


def test_a_queued_run_is_planned_on_idle_cards_and_waits_for_their_memory(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path
) -> None:
    """Card 1 of the busy recording has 6 GiB held by an inference server: full DDP (18.5 GiB a
    card) does not fit now; queued, it is planned on the cards idle and waits for card 1."""
    recording = Path(__file__).parents[1] / "data" / "nvml" / "2x3090-busy.json"
    monkeypatch.setenv("HOMELAB_DP_FAKE_NVML", str(recording))
    overrides = [
        "hardware.devices=auto",
        "train.activation_checkpointing=false",
        "train.distribution=ddp",
        "train.tiled_mlp=off",
    ]  # a tiled MLP would fit now
    planned = make_plan(open_preset("qwen2-0.5b-full-ddp", overrides))
    assert not planned.plan.fits and planned.plan.fits_when_idle
    queued = on_idle_cards(planned, None)
    assert queued.plan.fits and queued.plan.idle is None
    need = queued.plan.to_json()["per_device_bytes"]["total"]  # what the keeper reads
    wait = waiting("me", 1.0, Devices(False, (0, 1)), [], free_memory([0, 1]), need)
    assert wait.waiting_for == ("memory on GPU 1",)
