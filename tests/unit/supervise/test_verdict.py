"""The keeper's verdict (`homelab_dp.supervise.launch_verdict.decide`) on recorded launches, branch by branch.

tests/data/verdicts/CASE/ holds what one real launch left behind and the verdict the keeper gave
it before the verdict became a pure function (see its README). Every recording gets that same
verdict back; the tests below then take each branch in the order `decide` tries them, and
change one input of a recording to reach what no injected fault produces by itself (a stopped
run with an error, a node without rank 0, a rank that exits before it can write its error…).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest

from homelab_dp.runs.folder.run_state import diagnose_failure, read_error_files, signal_name
from homelab_dp.runs.run_events import EndEvent, ErrorEvent, Event, parse_event
from homelab_dp.supervise.launch_verdict import Attempt, Verdict, decide
from homelab_dp.supervise.watchdog import Stall

DATA = Path(__file__).resolve().parents[2] / "data" / "verdicts"
RECORDED = sorted(p.name for p in DATA.iterdir() if p.is_dir())


def recorded(case: str, **changes: Any) -> Attempt:
    """The verdict's inputs as the keeper gathered them for the recorded launch ``case``."""
    folder = DATA / case
    inputs = json.loads((folder / "inputs.json").read_text(encoding="utf-8"))
    lines = (folder / "events.jsonl").read_text(encoding="utf-8").splitlines()
    events = [e for e in (parse_event(json.loads(line)) for line in lines) if e is not None]
    attempt = Attempt(
        exit_code=inputs["exit_code"],
        events=events,
        log_text=(folder / "launcher.log").read_text(encoding="utf-8"),
        launcher_log=str(folder / "launcher.log"),
        stop_requested=inputs["stop_requested"],
        stall=Stall(**inputs["stall"]) if inputs["stall"] else None,
        orphans=inputs["orphans"],
        nnodes=inputs["nnodes"],
    )
    return dataclasses.replace(attempt, **changes)


def events_of(case: str, drop: type[Event] | None = None) -> list[Event]:
    return [e for e in recorded(case).events if drop is None or not isinstance(e, drop)]


def test_every_branch_has_a_recording() -> None:
    assert RECORDED == ["agent-sigkill", "agent-sigterm", "bad-data", "completed", "enospc",
                        "oom", "port", "sigkill", "stall", "stop"]  # fmt: skip


@pytest.mark.parametrize("case", RECORDED)
def test_each_recorded_launch_gets_the_verdict_the_keeper_gave_it(case: str) -> None:
    doc = json.loads((DATA / case / "expected.json").read_text(encoding="utf-8"))
    assert decide(recorded(case)) == Verdict(doc["status"], doc["reason"], doc["failure"])


# ------------------------------------------------------------------ 1. the watchdog's stall


def test_1_a_stall_is_the_cause_not_the_sigkill_the_watchdog_sent() -> None:
    attempt = recorded("stall")
    assert "Signal 9 (SIGKILL) received by PID 13415" in attempt.log_text  # rank 0, killed by us
    verdict = decide(attempt)
    assert verdict.status == "failed"
    assert verdict.reason.startswith("stalled: rank 1 (pid 13416) stalled at step 3: its ")
    assert verdict.reason.endswith("; the watchdog ended the run")
    assert verdict.failure == {"kind": "stall", "rank": 1, "pid": 13416, "step": 3, "idle_s": 4.1}


def test_1_the_stall_wins_even_over_a_completed_end() -> None:
    stall = Stall(None, None, 7, 12.345, "every rank on this node waits in a collective")
    verdict = decide(recorded("completed", stall=stall))
    assert verdict.failure == {"kind": "stall", "rank": None, "pid": None, "step": 7,
                               "idle_s": 12.3}  # fmt: skip


# ------------------------------------------------------------------ 2. completed


def test_2_completed_needs_the_end_event_and_torchrun_exit_0() -> None:
    assert decide(recorded("completed")) == Verdict("completed", "4 steps, result in final/")
    # A rank that failed after rank 0 wrote its end (tearing down): not completed.
    failed = decide(recorded("completed", exit_code=1))
    assert failed == Verdict("failed", "torchrun exited with code 1", {"kind": "unknown"})


# ------------------------------------------------------------------ 3. stopped gracefully

RESUME = "; resume with `homelab-dp resume`"


def test_3_the_agent_killed_the_keeper_stopped_the_orphans() -> None:
    verdict = decide(recorded("agent-sigkill"))
    assert verdict.status == "failed"
    assert verdict.reason == (
        "the torchrun agent was killed by SIGKILL; the keeper stopped its workers (stopped at "
        "step 5 with a checkpoint)" + RESUME
    )
    assert verdict.failure == {"kind": "agent", "signal": "SIGKILL", "orphans": [13327, 13328]}


def test_3_a_requested_stop_is_an_interruption_whatever_ended_the_agent() -> None:
    assert decide(recorded("stop")) == Verdict(
        "interrupted", "stopped by request: stopped at step 4 with a checkpoint" + RESUME
    )
    verdict = decide(recorded("agent-sigkill", stop_requested=True))
    assert verdict == Verdict(
        "interrupted", "stopped by request: stopped at step 5 with a checkpoint" + RESUME
    )


def test_3_a_signal_the_agent_received_and_forwarded() -> None:
    attempt = recorded("agent-sigterm")
    assert "Received 15 death signal" in attempt.log_text
    assert decide(attempt) == Verdict(
        "interrupted",
        "the torchrun agent received SIGTERM: stopped at step 2 with a checkpoint" + RESUME,
    )


def test_3_stopped_without_a_request_or_a_signal_to_the_agent() -> None:
    # The workers were signalled directly (`stop` falls back to them when the keeper is gone).
    assert decide(recorded("stop", stop_requested=False)) == Verdict(
        "interrupted", "stopped: stopped at step 4 with a checkpoint" + RESUME
    )


def test_3_a_stop_with_an_error_event_is_a_failure() -> None:
    error = ErrorEvent(message="OSError: disk gone", rank=0, kind="OSError")
    verdict = decide(recorded("agent-sigterm", events=[*events_of("agent-sigterm"), error]))
    assert verdict == Verdict(
        "failed",
        "rank 0: OSError: disk gone",
        {"kind": "error", "rank": 0, "error": "OSError", "hint": None},
    )


# ------------------------------------------------------------------ 4. rank 0 on another node


def test_4_a_node_without_rank_0_completes_on_torchrun_exit_0() -> None:
    # Only the controller's "starting" state in this node's events: rank 0 wrote its own.
    node = recorded("port", exit_code=0, log_text="", nnodes=2)
    assert decide(node) == Verdict(
        "completed", "this node's workers finished; rank 0 ran on another node"
    )
    single = decide(dataclasses.replace(node, nnodes=1))
    assert single == Verdict("failed", "torchrun exited with code 0", {"kind": "unknown"})


# ------------------------------------------------------------------ 5. out of memory


def test_5_out_of_memory_names_the_rank_and_carries_the_proposal() -> None:
    attempt = recorded("oom")
    echoes = [e for e in attempt.events if isinstance(e, ErrorEvent) and e.rank == 0]
    assert echoes and "Connection closed by peer" in echoes[0].message  # the peer's echo
    verdict = decide(attempt)
    assert verdict.reason.startswith("rank 1: out of memory with micro-batch 2 × accumulation 2")
    assert verdict.failure is not None and verdict.failure["kind"] == "oom"
    assert verdict.failure["proposal"] == {"micro_batch": 1, "grad_accum": 4,
                                           "activation_checkpointing": False, "effective_batch": 8}  # fmt: skip
    assert "same effective batch 8" in verdict.failure["hint"]


# ------------------------------------------------------------------ 6. a rank killed by a signal


def test_6_the_killed_rank_not_the_connection_reset_of_its_peer() -> None:
    attempt = recorded("sigkill")
    assert any("Connection reset by peer" in e.message for e in attempt.events
               if isinstance(e, ErrorEvent) and e.rank == 0)  # fmt: skip
    assert decide(attempt) == Verdict(
        "failed",
        "rank 1 (pid 12513) was killed by signal SIGKILL (9)",
        {"kind": "signal", "rank": 1, "pid": 12513, "signal": "SIGKILL"},
    )


# ------------------------------------------------------------------ 7. a rank's error event


def test_7_the_root_cause_ranks_own_error_else_the_first() -> None:
    failure = {"kind": "error", "rank": 1, "error": "DataError",
               "hint": "check data.path (a local .jsonl or .txt file)"}  # fmt: skip
    expected = Verdict("failed", "rank 1: /tmp/recroot/bad.jsonl: no such data file", failure)
    assert decide(recorded("bad-data")) == expected
    # Rank 0's error written first: torchrun's root cause (rank 1) still picks rank 1's.
    swapped = list(reversed(events_of("bad-data")))
    assert decide(recorded("bad-data", events=swapped)) == expected
    # Without torchrun's summary, the first error event.
    first = decide(recorded("bad-data", events=swapped, log_text=""))
    assert first.reason == "rank 0: /tmp/recroot/bad.jsonl: no such data file"
    assert first.failure is not None and first.failure["rank"] == 0


def test_7_a_checkpoint_error_names_its_rank_itself() -> None:
    verdict = decide(recorded("enospc"))
    assert verdict.reason.startswith("checkpoint step-2: no space left on device writing ")
    assert verdict.reason.endswith("/checkpoints/.tmp-step-2 (rank 1); no earlier checkpoint")
    assert verdict.failure is not None
    assert (verdict.failure["kind"], verdict.failure["error"]) == ("error", "CheckpointError")


# ------------------------------------------------------------------ 8. a rank's exit code


def test_8_a_rank_that_exited_without_an_error_event() -> None:
    # E.g. a rank that could not read spec.json: exit 2 before it could write an event.
    attempt = recorded("bad-data", events=events_of("bad-data", drop=ErrorEvent))
    assert decide(attempt) == Verdict(
        "failed",
        "rank 1 (pid 13548) exited with code 2",
        {"kind": "exit", "rank": 1, "exitcode": 2},
    )


# ------------------------------------------------------------------ 9. the agent killed


def test_9_the_agent_killed_before_the_ranks_could_stop() -> None:
    attempt = recorded("agent-sigkill", events=events_of("agent-sigkill", drop=EndEvent))
    assert attempt.agent_signal == "SIGKILL"
    assert decide(attempt) == Verdict(
        "failed",
        "the torchrun agent was killed by SIGKILL",
        {"kind": "agent", "signal": "SIGKILL", "orphans": [13327, 13328]},
    )


# ------------------------------------------------------------------ 10. the rendezvous port


def test_10_the_rendezvous_port_taken() -> None:
    port = 38889  # the port of the recording
    assert decide(recorded("port")) == Verdict(
        "failed",
        f"127.0.0.1:{port} is already in use: the rendezvous could not start",
        {"kind": "port"},
    )
    bare = recorded("port", log_text="RuntimeError: address already in use\n")
    assert decide(bare).reason == "the rendezvous port is already in use: the rendezvous could " \
        "not start"  # fmt: skip


# ------------------------------------------------------------------ 11. anything else


TORCHRUN_ERROR_FILE = {  # the shape torchrun's @record writes (torch.distributed.elastic)
    "message": {
        "message": "RuntimeError: CUDA error: an illegal memory access was encountered",
        "extraInfo": {"py_callstack": "Traceback …", "timestamp": "1796100450"},
    }
}


def test_11_unknown_reads_torchruns_error_files_then_its_log() -> None:
    path = "/runs/r/logs/r/attempt_0/1/error.json"
    with_file = recorded("port", log_text="", error_files=[(path, TORCHRUN_ERROR_FILE)])
    assert decide(with_file) == Verdict(
        "failed",
        f"rank 1: RuntimeError: CUDA error: an illegal memory access was encountered (see {path})",
        {"kind": "unknown"},
    )
    # A log cut short before torchrun's summary: the last exit code it mentions.
    head = "".join((DATA / "stall" / "launcher.log").read_text().splitlines(True)[:2])
    cut = recorded("port", log_text=head)
    log = str(DATA / "port" / "launcher.log")
    assert decide(cut).reason == f"rank 0: signal SIGKILL (9) (see {log})"
    nothing = recorded("port", log_text="")
    assert decide(nothing) == Verdict("failed", "torchrun exited with code 1", {"kind": "unknown"})


def test_the_agents_signal_comes_from_its_exit_code() -> None:
    assert Attempt(exit_code=-15).agent_signal == "SIGTERM"
    assert Attempt(exit_code=1).agent_signal is None
    assert Attempt(exit_code=None).agent_signal is None
    assert signal_name(99) == "signal 99"


def test_the_keepers_fallback_reads_this_launchs_log_and_the_error_files(tmp_path: Path) -> None:
    """What the keeper and `current_state` gather: the log from an offset, the error files."""
    logs = tmp_path / "logs"
    (logs / "r" / "attempt_0" / "0").mkdir(parents=True)
    earlier = (DATA / "sigkill" / "launcher.log").read_text(encoding="utf-8")
    (logs / "launcher.log").write_text(earlier + "restarted\n", encoding="utf-8")
    since = len(earlier.encode("utf-8"))
    assert "was killed by signal SIGKILL" in str(diagnose_failure(tmp_path))  # the old summary
    assert diagnose_failure(tmp_path, since) is None  # not this launch's
    err = logs / "r" / "attempt_0" / "0" / "error.json"
    err.write_text(json.dumps(TORCHRUN_ERROR_FILE), encoding="utf-8")
    (logs / "broken").mkdir()
    (logs / "broken" / "error.json").write_text("{not json", encoding="utf-8")
    assert read_error_files(tmp_path) == [(str(err), TORCHRUN_ERROR_FILE)]
    assert diagnose_failure(tmp_path, since) == (
        f"rank 0: RuntimeError: CUDA error: an illegal memory access was encountered (see {err})"
    )
