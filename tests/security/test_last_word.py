"""The supervisor's last word (issue 34, item 10), without a training run.

- A run whose keeper died (SIGKILL, a reboot) while state.json still says it is active is
  settled from what it left: completed when this launch's end event names the result and
  final/ is there, interrupted when a stop was requested, else failed — and the first reader
  writes that final state and runs the notification once. Damaged and hostile event files of
  every kind: a torn line, a non-object line, nesting 100,000 deep, an end event of an earlier
  launch, an end without final/, final/ without an end, a completed end without final_path.
- A requested stop is "interrupted — stopped by request" at any moment: the keeper's verdict
  on each recorded failure shape when a stop was requested (a rank killed by SIGTERM or
  SIGKILL, an agent killed, a bad-data error, a completed end with a nonzero exit).
- A full disk (RLIMIT_FSIZE in a child: no root, no tmpfs): `resume` is exit 2 with a hint and
  leaves nothing behind; the result (final/) written on it names its path and the hint, not
  safetensors' raw "Error while serializing".
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from homelab_dp.app.runs import RunController
from homelab_dp.runs.folder.run_folder import write_json_atomic
from homelab_dp.runs.folder.run_state import current_state, process_start, read_state
from homelab_dp.supervise.keeper import settle_dead_run
from homelab_dp.supervise.launch_verdict import decide
from tests.unit.supervise.test_verdict import recorded

from ..conftest import DATA, ROOT

COMPLETED = DATA / "bad_input" / "runs" / "completed-run"
LIVENESS_S = 60.0  # the notifier's process starts in about 0.3 s; this only ends a hang


def _dead_pid() -> int:
    """A pid that was a process and is no more (reaped)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _run(
    root: Path,
    name: str,
    events: list[dict | str],
    *,
    final: bool = True,
    keeper: int | None = None,
    **state: object,
) -> Path:
    """A run folder whose state says "running" with ``keeper`` as its keeper (default: a dead
    pid), the given events (a str is written as it is: a torn or hostile line)."""
    run = root / name
    shutil.copytree(COMPLETED, run)
    spec = json.loads((run / "spec.json").read_text(encoding="utf-8"))
    spec["run_id"] = name
    spec["notify"] = f'echo "$HOMELAB_DP_RUN_STATE" >> {root / (name + ".notified")}'
    (run / "spec.json").write_text(json.dumps(spec), encoding="utf-8")
    (run / "logs").mkdir()
    pid = keeper or _dead_pid()
    doc = {"status": "running", "run_id": name, "attempt": 1, "created": time.time(),
           "pids": {"keeper": pid, "agent": None, "monitor": None, "workers": []},
           "starts": {str(pid): process_start(pid) or 1}, **state}  # fmt: skip
    (run / "state.json").write_text(json.dumps(doc), encoding="utf-8")
    lines = [e if isinstance(e, str) else json.dumps(e) for e in events]
    (run / "events.jsonl").write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    if final:
        (run / "final").mkdir()
    return run


STARTING = {"type": "state", "status": "starting", "run_id": "x"}
STEP = {"type": "step", "step": 3, "loss": 1.0}
END = {"type": "end", "reason": "completed", "steps": 4, "final_path": "/x/final"}


def _notified(run: Path) -> list[str]:
    path = run.parent / (run.name + ".notified")
    deadline = time.monotonic() + LIVENESS_S
    while not path.exists():
        assert time.monotonic() < deadline, (run / "logs" / "keeper.log").read_text()
        time.sleep(0.05)
    time.sleep(0.5)  # a second notification, were there one, has time to land
    return path.read_text().split()


# -- a dead keeper's run is settled from its events


def test_a_completed_run_whose_keeper_was_killed_is_completed_and_notified_once(
    tmp_path: Path,
) -> None:
    run = _run(tmp_path, "done", [STARTING, STEP, END])
    assert current_state(run)["status"] == "completed"  # any reader, before anyone writes
    doc = RunController(tmp_path).status(str(run))
    assert doc["status"] == "completed" and "its keeper died" in doc["reason"]
    assert read_state(run)["status"] == "completed"  # written, once
    assert read_state(run)["settled_after_keeper"] is True
    assert json.loads((run / "events.jsonl").read_text().splitlines()[-1])["status"] == "completed"
    assert settle_dead_run(run) is False  # settled already: no second state, no second notice
    RunController(tmp_path).status(str(run))
    assert _notified(run) == ["completed"]


@pytest.mark.parametrize(
    ("events", "final", "why"),
    [
        ([STARTING, STEP], True, "no end event: died mid-run"),
        ([STARTING, STEP, END], False, "final/ is not there"),
        ([STARTING, {**END, "final_path": None}], True, "the end names no result"),
        ([STARTING, {**END, "final_path": 7}], True, "a final_path of the wrong type"),
        ([STARTING, END, {**STARTING, "resume": True}, STEP], True, "an earlier launch's end"),
        ([STARTING, {**END, "reason": "stopped"}], True, "stopped, not completed"),
        ([STARTING, STEP, '{"type": "end", "reason": "compl'], True, "a torn end line"),
        ([STARTING, STEP, "[1, 2]", "null", '"end"'], True, "lines that are no objects"),
        ([STARTING, STEP, "[" * 100_000 + "]" * 100_000], True, "nesting 100,000 deep"),
        ([STARTING, STEP, b"\xff\xfe".decode("latin-1")], True, "bytes that are not UTF-8"),
    ],
)
def test_a_dead_keepers_run_without_a_whole_result_is_failed(
    tmp_path: Path, events: list, final: bool, why: str
) -> None:
    run = _run(tmp_path, "dead", events, final=final)
    state = current_state(run)
    assert state["status"] == "failed", why
    assert "died without a final state" in state["reason"]
    assert RunController(tmp_path).status(str(run))["status"] == "failed"
    assert _notified(run) == ["failed"]


def test_a_requested_stop_whose_keeper_died_is_interrupted(tmp_path: Path) -> None:
    """`stop` marks the request before it signals; the keeper may die of that very signal
    (before its handler is in place): the run was stopped by request, not failed."""
    run = _run(tmp_path, "stopped", [STARTING], final=False, stop_requested=time.time())
    doc = RunController(tmp_path).status(str(run))
    assert doc["status"] == "interrupted" and doc["reason"].startswith("stopped by request")
    assert "homelab-dp resume stopped" in doc["reason"]


def test_a_live_keeper_is_never_overruled(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        run = _run(tmp_path, "live", [STARTING, STEP, END], keeper=sleeper.pid)
        assert settle_dead_run(run) is False
        assert RunController(tmp_path).status(str(run))["status"] == "running"
        assert read_state(run)["status"] == "running"
        assert not (tmp_path / "live.notified").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_one_reader_of_many_settles(tmp_path: Path) -> None:
    run = _run(tmp_path, "many", [STARTING, STEP, END])
    code = (f"from homelab_dp.supervise.keeper import settle_dead_run; from pathlib import Path; "
            f"print(settle_dead_run(Path({str(run)!r})))")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env,
                              text=True) for _ in range(4)]  # fmt: skip
    said = sorted(p.communicate(timeout=LIVENESS_S)[0].strip() for p in procs)
    assert said == ["False", "False", "False", "True"]
    assert _notified(run) == ["completed"]
    states = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()[3:]]
    assert [e["status"] for e in states] == ["completed"]


# -- a requested stop is an interrupted run, whatever the ranks' exits say


@pytest.mark.parametrize("case", ["sigkill", "agent-sigterm", "agent-sigkill", "bad-data",
                                  "enospc"])  # fmt: skip
def test_a_requested_stop_is_interrupted_at_any_moment(case: str) -> None:
    verdict = decide(recorded(case, stop_requested=True))
    assert verdict.status == "interrupted", verdict
    assert verdict.reason.startswith("stopped by request") and verdict.failure is None
    assert "homelab-dp resume" in verdict.reason


def test_a_stop_during_start_up_is_interrupted_not_a_sigterm_failure() -> None:
    """What a stop one second after the start leaves: no event of the ranks, torchrun's summary
    of a rank killed by SIGTERM (its handler was not in place yet)."""
    log = textwrap.dedent("""\
        Root Cause (first observed failure):
        [0]:
          time      : 2026-12-04_23:00:00
          host      : h
          rank      : 0 (local_rank: 0)
          exitcode  : -15 (pid: 4242)
          error_file: <N/A>
          traceback : Signal 15 (SIGTERM) received by PID 4242
        ============================================================
        """)  # fmt: skip
    base = dataclasses.replace(recorded("sigkill"), events=[], log_text=log, exit_code=1)
    assert decide(base).status == "failed"  # nobody asked: a SIGTERM from outside is a failure
    verdict = decide(dataclasses.replace(base, stop_requested=True))
    assert verdict.status == "interrupted"
    assert verdict.reason.startswith("stopped by request during start-up, before its first step")


def test_a_stop_as_the_result_is_whole_is_completed_and_oom_stays_a_failure() -> None:
    done = recorded("completed", stop_requested=True, exit_code=1)
    assert decide(done).status == "completed"
    oom = decide(recorded("oom", stop_requested=True))
    assert oom.status == "failed" and oom.failure and oom.failure["kind"] == "oom"


# -- a full disk: nothing left behind, the path and the hint named


def _full_disk() -> None:
    """``preexec_fn``: every file write beyond 0 bytes fails with EFBIG (a full disk's effect on
    a writer), SIGXFSZ ignored so the write returns the error instead of killing the process."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}  # fmt: skip


def test_resume_on_a_full_disk_is_exit_2_and_leaves_the_run_as_it_was(tmp_path: Path) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    run = root / "stopped-run"
    shutil.copytree(COMPLETED, run)
    state = json.loads((run / "state.json").read_text())
    (run / "state.json").write_text(json.dumps({**state, "status": "interrupted"}))
    before = _snapshot(run)
    out = subprocess.run(
        [sys.executable, "-m", "homelab_dp.cli", "resume", "stopped-run", "--runs", str(root)],
        capture_output=True, text=True, preexec_fn=_full_disk, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert (
        f"error: run stopped-run: cannot write {run / 'spec.json'} (File too large)" in out.stderr
    )
    assert "hint: free space on the disk of" in out.stderr
    assert _snapshot(run) == before  # no temporary spec, no changed state, no event, no log


def test_an_atomic_json_write_that_fails_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text('{"old": true}\n')
    code = (f"from homelab_dp.runs.folder.run_folder import write_json_atomic; "
            f"from pathlib import Path; write_json_atomic(Path({str(target)!r}), {{'x': 1}})")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         preexec_fn=_full_disk, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         timeout=60)  # fmt: skip
    assert out.returncode == 1 and f"File too large: '{target}'" in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
    assert target.read_text() == '{"old": true}\n'
    write_json_atomic(target, {"x": 1})  # space again: it writes
    assert json.loads(target.read_text()) == {"x": 1}


RESULT_ON_FULL_DISK = """
import os, resource, signal, sys
from pathlib import Path
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.train.loop.checkpoints import CheckpointError, save_result
from homelab_dp.train.parallelism.strategy import Strategy

run_dir, model_dir = Path(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo", init_method=f"file://{run_dir / 'pg'}", rank=0, world_size=1)
model = AutoModelForCausalLM.from_pretrained(model_dir)
tokenizer = AutoTokenizer.from_pretrained(model_dir)
preset = preset_from_dict({"model": {"path": model_dir}, "data": {"path": "-"}})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
try:
    save_result(run_dir, Strategy("ddp", model, model), False, tokenizer, preset, step=4)
except CheckpointError as exc:
    print(exc.message)
    print(exc.hint)
    sys.exit(3)
"""


def test_a_full_disk_while_the_result_is_written_names_the_path_and_the_hint(
    tmp_path: Path,
) -> None:
    """The real model's safetensors (5 MB) on a 64 KiB file-size limit: safetensors' Rust writer
    fails ("Error while serializing: I/O error: File too large (os error 27)")."""
    run = tmp_path / "run-full"
    run.mkdir()
    model = ROOT / "assets" / "models" / "tiny-llama"
    out = subprocess.run([sys.executable, "-c", RESULT_ON_FULL_DISK, str(run), str(model)],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                         timeout=300)  # fmt: skip
    assert out.returncode == 3, out.stderr[-3000:]
    message, hint = out.stdout.strip().splitlines()
    assert message.startswith(f"the result: writing {run / '.final-tmp'} failed (file too large")
    assert "serializing" not in message and "os error" not in message
    assert hint.startswith(f"free space on the disk of {run} (df -h), then `homelab-dp resume")
    assert not (run / ".final-tmp").exists() and not (run / "final").exists()
