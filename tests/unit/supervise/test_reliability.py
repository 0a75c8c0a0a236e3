"""The pure parts of fault handling: OOM proposals, the watchdog's clock and verdict, torchrun's
root cause, and the checkpoint file checks (the runs themselves: tests/integration/test_faults.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import pytest

from homelab_dp.runs.folder.heartbeats import heartbeat_dir, write_heartbeat
from homelab_dp.runs.folder.run_folder import create_run_dir, read_run_spec
from homelab_dp.runs.folder.run_state import torchrun_root_cause
from homelab_dp.runs.run_spec import Resolved, RunSpec
from homelab_dp.supervise.relaunch import apply_oom_proposal
from homelab_dp.supervise.watchdog import Watchdog, describe_stall
from homelab_dp.train.loop.checkpoints import check_checkpoint, check_shard
from homelab_dp.train.loop.rank_guard import oom_advice
from tests.conftest import DATA

RECORDED_V1 = DATA / "events" / "20250301-101500-smollm2-135m-lora-7f3a" / "spec.json"


def _resolved(micro: int, accum: int, ac: bool = False, world: int = 2) -> Resolved:
    return Resolved(method="full", distribution="ddp", activation_checkpointing=ac, device="cpu",
                    world_size=world, dtype="fp32", micro_batch=micro, grad_accum=accum, lr=1e-4)  # fmt: skip


@pytest.mark.parametrize(
    ("micro", "accum", "ac", "expected"),
    [
        (4, 2, False, (2, 4, False)),  # halve the micro-batch, double the accumulation
        (6, 1, True, (3, 2, True)),  # the smallest factor: 6 = 2 × 3
        (3, 1, False, (1, 3, False)),
        (1, 4, False, (1, 4, True)),  # micro-batch 1: activation checkpointing
        (1, 4, True, None),  # nothing left to change in this run
    ],
)
def test_oom_proposal_keeps_the_effective_batch(micro, accum, ac, expected) -> None:
    message, hint, proposal = oom_advice(_resolved(micro, accum, ac), MemoryError("boom"))
    assert f"micro-batch {micro} × accumulation {accum}" in message and "boom" in message
    if expected is None:
        assert proposal is None and "lora" in hint
        return
    got = (proposal["micro_batch"], proposal["grad_accum"], proposal["activation_checkpointing"])
    assert got == expected
    assert proposal["effective_batch"] == micro * 2 * accum == got[0] * 2 * got[1]
    assert "--auto-fit" in hint


def test_the_keeper_asks_planning_for_the_next_batch_after_out_of_memory(tmp_path: Path) -> None:
    """The worker only reports the failed step; the keeper's retry takes planning's next batch
    from the spec (`planning.batch_shape.after_out_of_memory`), whatever the event proposed."""
    spec = replace(RunSpec.from_json(json.loads(RECORDED_V1.read_text(encoding="utf-8"))),
                   run_id="oom-retry")  # fmt: skip
    run_dir = create_run_dir(spec, tmp_path)  # micro-batch 4 × 2 ranks × accumulation 4 = 32
    report = {"kind": "oom", "rank": 1, "proposal": None}
    assert apply_oom_proposal(run_dir, {"kind": "stall", "rank": 1}) is None
    seen = []
    while (change := apply_oom_proposal(run_dir, report)) is not None:
        r = read_run_spec(run_dir).resolved
        seen.append((r.micro_batch, r.grad_accum, r.activation_checkpointing, r.effective_batch))
        assert (
            read_run_spec(run_dir).resume and f"same effective batch {r.effective_batch}" in change
        )
    assert seen == [(2, 8, False, 32), (1, 16, False, 32), (1, 16, True, 32)]
    assert len(read_run_spec(run_dir).retries) == 3  # nothing left: the spec is unchanged
    t = read_run_spec(run_dir).preset.train
    assert (t.micro_batch, t.grad_accum, t.activation_checkpointing) == (1, 16, True)


def _beat(run_dir: Path, rank: int, step: int, micro: int, pid: int, t: float) -> None:
    folder = heartbeat_dir(run_dir)
    folder.mkdir(parents=True, exist_ok=True)
    write_heartbeat(folder / f"rank-{rank}.json", {"rank": rank, "pid": pid, "step": step,
                    "micro": micro, "phase": "train", "time": t})  # fmt: skip


def test_watchdog_arms_on_training_and_fires_after_its_limit(tmp_path: Path) -> None:
    dog = Watchdog(tmp_path, limit_s=10)
    assert dog.check(now=0) is None and dog.check(now=100) is None  # loading: not armed
    _beat(tmp_path, 0, 1, 0, os.getpid(), 1.0)
    assert dog.check(now=100) is None and dog.armed  # a change: the clock restarts
    assert dog.check(now=109) is None
    _beat(tmp_path, 0, 2, 0, os.getpid(), 2.0)
    assert dog.check(now=115) is None  # progress at 115
    stall = dog.check(now=126)
    assert stall is not None and stall.idle_s == 11 and "no rank made progress for 11 s" in (
        stall.message)  # fmt: skip
    assert Watchdog(tmp_path, limit_s=0).check(now=1e9) is None  # 0 turns it off


def test_the_stalled_rank_is_the_stopped_one_else_the_one_behind(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(
        [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    try:
        assert sleeper.stdout is not None and sleeper.stdout.readline() == b"up\n"  # started
        beats = {0: {"rank": 0, "pid": os.getpid(), "step": 5, "micro": 1},
                 1: {"rank": 1, "pid": sleeper.pid, "step": 5, "micro": 0}}  # fmt: skip
        behind = describe_stall(beats, 12.0, 10)
        assert behind.rank == 1
        assert "stalled at step 5 micro-step 0 while others reached step 5 micro-step 1" in (
            behind.message
        )
        beats[1]["micro"] = 1
        waiting = describe_stall(beats, 12.0, 10)
        assert waiting.rank is None and "every rank on this node waits" in waiting.message
        sleeper.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10  # liveness guard: the signal lands in milliseconds
        stopped = describe_stall(beats, 12.0, 10)
        while stopped.rank is None and time.monotonic() < deadline:
            time.sleep(0.01)
            stopped = describe_stall(beats, 12.0, 10)
        assert stopped.rank == 1 and "state T" in stopped.message
    finally:
        sleeper.kill()
        sleeper.wait()


def test_a_passing_disk_sleep_is_not_a_culprit_and_a_lasting_one_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A healthy process passes through state D for milliseconds (paging, a write): one D
    reading must not name it; a rank that stays in D is the stalled one (psutil is the OS
    boundary, so its readings are the fake)."""
    readings: list[str] = []

    def status(self: psutil.Process) -> str:
        if self.pid != os.getpid():
            return psutil.STATUS_SLEEPING
        return readings.pop(0) if len(readings) > 1 else readings[0]

    monkeypatch.setattr(psutil.Process, "status", status)
    beats = {0: {"rank": 0, "pid": 999_999_999, "step": 5, "micro": 1},
             1: {"rank": 1, "pid": os.getpid(), "step": 5, "micro": 1}}  # fmt: skip
    readings[:] = [psutil.STATUS_DISK_SLEEP, psutil.STATUS_RUNNING]
    passing = describe_stall(beats, 12.0, 10)
    assert "state D" not in passing.message and passing.rank == 0  # rank 0's pid is gone
    readings[:] = [psutil.STATUS_DISK_SLEEP]
    lasting = describe_stall(beats, 12.0, 10)
    assert lasting.rank == 1 and "uninterruptible I/O (state D)" in lasting.message


SUMMARY = """homelab_dp.train.loop.worker FAILED
-------------------------------------------------------
Failures:
[1]:
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 101)
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-29_16:48:41
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 102)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 102
=======================================================
"""


def test_root_cause_is_the_first_failure_not_its_echo() -> None:
    root = torchrun_root_cause("old attempt\n" + SUMMARY.replace("-9", "1") + SUMMARY)
    assert (root.rank, root.exitcode, root.pid, root.signal) == (1, -9, 102, "SIGKILL")
    assert root.describe() == "rank 1 (pid 102) was killed by signal SIGKILL (9)"
    assert torchrun_root_cause("no summary") is None


ABORT_OBSERVED_FIRST = """homelab_dp.train.loop.worker FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-11-30_10:02:07
  rank      : 1 (local_rank: 1)
  exitcode  : -9 (pid: 5448)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 5448
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-11-30_10:02:07
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 5447)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 5447
=======================================================
"""


def test_a_sigkilled_rank_is_the_cause_even_when_a_peers_abort_was_observed_first() -> None:
    """Seen in CI: rank 1 SIGKILLed mid-checkpoint, rank 0 aborted by gloo (SIGABRT) and torchrun
    observed the abort first. The kill is the cause; the abort is its echo."""
    root = torchrun_root_cause(ABORT_OBSERVED_FIRST)
    assert root.describe() == "rank 1 (pid 5448) was killed by signal SIGKILL (9)"
    # Without a SIGKILL among the failures, torchrun's root cause stands.
    plain = ABORT_OBSERVED_FIRST.replace("exitcode  : -9", "exitcode  : 1")
    assert (
        torchrun_root_cause(plain).describe()
        == "rank 0 (pid 5447) was killed by signal SIGABRT (6)"
    )


def _safetensors(path: Path, metadata: dict | None, data: bytes = b"\0" * 16) -> None:
    header = {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, len(data)]}}
    if metadata is not None:
        header["__metadata__"] = metadata
    raw = json.dumps(header).encode()
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + data)


def test_checkpoint_checks_name_the_file(tmp_path: Path) -> None:
    good = {"DCP_SHARDING_INFO": json.dumps({"w": {"saved_offsets": [0]}})}
    ckpt = tmp_path / "step-4"
    ckpt.mkdir()
    shard = ckpt / "shard-00001-model-00001-of-00001.safetensors"
    _safetensors(shard, good)
    assert check_shard(shard) is None
    (ckpt / "trainer.json").write_text('{"step": 4}')
    marker = {"step": 4, "files": {shard.name: shard.stat().st_size}}
    (ckpt / "COMPLETE").write_text(json.dumps(marker))
    assert check_checkpoint(ckpt) is None
    os.truncate(shard, shard.stat().st_size - 4)
    assert check_checkpoint(ckpt) == f"{shard}: truncated ({shard.stat().st_size} bytes, its " \
        f"header describes {shard.stat().st_size + 4})"  # fmt: skip
    _safetensors(shard, {"format": "pt"})
    assert check_checkpoint(ckpt) == (
        f"{shard}: missing its checkpoint metadata (DCP_SHARDING_INFO in the header)"
    )
    _safetensors(shard, good, data=b"\0" * 20)  # whole, but not what was written
    assert "changed since it was written" in check_checkpoint(ckpt)
    shard.unlink()
    assert check_checkpoint(ckpt) == f"{shard}: missing (the completion marker lists it)"
    (ckpt / "COMPLETE").unlink()
    assert check_checkpoint(ckpt) == f"{ckpt / 'COMPLETE'}: missing or unreadable completion marker"
