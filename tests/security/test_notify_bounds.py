"""The notifier (and the end-of-run benchmarks) cannot hurt the keeper that runs them.

Hostile and damaged notifiers: a command printing 300 MB (the keeper keeps only the end of
it), one that outlives its timeout with a child in the background (the whole process group is
killed), one that leaves a child running and exits (the keeper does not wait for the child),
and run values no environment can hold (a NUL, lone surrogates, line breaks, a megabyte of
reason) or a command holding a NUL: logged or cleaned, never a crash."""

from __future__ import annotations

import json
import os
import resource
import shutil
import time
from pathlib import Path

import pytest

from homelab_dp.supervise import notifier
from homelab_dp.supervise.keeper import after_end
from tests.conftest import DATA

RECORDED = DATA / "events" / "20250301-101500-smollm2-135m-lora-7f3a"


def ended_run(tmp_path: Path, notify: str, reason: str | None = None) -> Path:
    run_dir = tmp_path / "runs" / "r1"
    shutil.copytree(RECORDED, run_dir)
    spec = json.loads((run_dir / "spec.json").read_text())
    spec.update(run_id="r1", notify=notify)
    (run_dir / "spec.json").write_text(json.dumps(spec))
    state = json.loads((run_dir / "state.json").read_text())
    state.update(status="failed", reason=reason)
    (run_dir / "state.json").write_text(json.dumps(state))
    return run_dir


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie awaiting its reaper counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def gone_within(pid: int, seconds: float) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return not alive(pid)


def test_300_mb_of_output_does_not_grow_the_keeper(capsys: pytest.CaptureFixture[str]) -> None:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    done = notifier.run_bounded("head -c 300000000 /dev/zero; echo; echo the-end; exit 4",
                                shell=True, timeout=120)  # fmt: skip
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert done.returncode == 4 and done.total == 300_000_000 + len("\nthe-end\n")
    assert len(done.tail) == notifier.OUTPUT_TAIL_BYTES and done.text.endswith("the-end")
    assert grown_mib < 64, grown_mib  # reading it all would grow the keeper by 300 MB or more


def test_the_whole_process_group_dies_at_the_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pid_file, deaf_file = tmp_path / "child.pid", tmp_path / "deaf.pid"
    monkeypatch.setattr(notifier, "NOTIFY_TIMEOUT_S", 1.0)
    monkeypatch.setattr(notifier, "KILL_GRACE_S", 0.5)
    # one child in the background, one that ignores SIGTERM (it needs the SIGKILL)
    command = (f"sleep 300 & echo $! > {pid_file}; (trap '' TERM; sleep 300) & "
               f"echo $! > {deaf_file}; sleep 300")  # fmt: skip
    start = time.monotonic()
    assert notifier.notify(command, tmp_path, "failed", "r1 failed") is False
    assert time.monotonic() - start < 30  # liveness: killed at 1 s, not after 300
    children = [int(pid_file.read_text()), int(deaf_file.read_text())]
    try:
        for child in children:
            assert gone_within(child, 10), "a backgrounded child survived the timeout"
    finally:
        for child in children:
            if alive(child):
                os.kill(child, 9)
    assert "killed after 1 s (its whole process group)" in capsys.readouterr().err


def test_a_child_left_in_the_background_does_not_hold_the_keeper(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pid_file = tmp_path / "child.pid"
    command = f"sleep 120 & echo $! > {pid_file}; echo sent"
    start = time.monotonic()
    try:
        assert notifier.notify(command, tmp_path, "completed", "r1 completed") is True
        assert time.monotonic() - start < 30  # liveness: the child holds stdout for 120 s
    finally:
        child = int(pid_file.read_text())
        if alive(child):
            os.kill(child, 9)
    assert "notified (completed)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "reason",
    ["bad\x00reason", "lone \udc80 surrogate \ud800", "two\nlines\r\x1b[31mred", "x" * 1_000_000],
    ids=["nul", "surrogates", "control", "megabyte"],
)
def test_hostile_run_values_reach_the_notifier_cleaned(tmp_path: Path, reason: str) -> None:
    out = tmp_path / "notified.txt"
    run_dir = ended_run(tmp_path, f'printf "%s" "$HOMELAB_DP_RUN_SUMMARY" > {out}', reason)
    after_end(run_dir)  # the old keeper: ValueError (embedded null byte) or UnicodeEncodeError
    summary = out.read_text(encoding="utf-8")
    assert summary.startswith("r1 failed: step 40/40")
    assert len(summary) <= notifier.TEXT_LIMIT and summary.isprintable()
    assert "\x00" not in summary and "\n" not in summary


@pytest.mark.parametrize("command", ["echo a\x00b", "/nonexistent/notifier"])
def test_a_command_that_cannot_run_is_logged(
    tmp_path: Path, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert notifier.notify(command, tmp_path, "completed", "r1 completed") is False
    err = capsys.readouterr().err
    assert "the notifier" in err and "\x00" not in err


def test_binary_output_of_a_failing_notifier_is_logged_as_text(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    command = "printf 'a\\000b\\377c' >&2; exit 5"
    assert notifier.notify(command, tmp_path, "completed", "r1 completed") is False
    err = capsys.readouterr().err
    assert "the notifier exited 5: ab\ufffdc" in err
