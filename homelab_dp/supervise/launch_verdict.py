"""The final verdict on one launch of a run: a pure function of what the launch left behind.

The keeper gathers an `Attempt` — torchrun's exit code, this launch's events, the launcher log
since this launch, whether a stop was requested, the watchdog's stall, the orphaned workers it
stopped, the node count and torchrun's error files — and `decide` turns it into a `Verdict`
(status, reason, failure record). Nothing here reads a file or a process: the same inputs give
the same verdict (tests/unit/supervise/test_verdict.py replays recorded ones).

The reason names the root cause, not its echo. In order, the first that applies:

1. the watchdog ended a stalled run → failed (``stall``), naming the rank;
2. rank 0's ``end`` event says completed (or early_stopped) and torchrun exited 0 → completed;
   (with a stop requested, a nonzero exit after a whole result is still completed);
3. the ranks stopped gracefully (``end`` stopped, no error): when the torchrun agent was killed
   by a signal nobody asked for, the keeper stopped its orphans → failed (``agent``); otherwise
   → interrupted, by request, by a signal the agent received (it forwards it), or just stopped;
3b. a stop was requested and the ranks did not stop gracefully (it came during start-up, or a
   rank died of the SIGTERM) → interrupted, stopped by request, at any moment; only an
   out-of-memory error stays a failure;
4. torchrun exited 0 without an ``end`` event on a multi-node run → completed (rank 0, which
   writes the events, ran on another node);
5. a rank ran out of memory → failed (``oom``) with its proposal; its peers only echo it;
6. torchrun saw a rank killed by a signal first → failed (``signal``);
7. a rank wrote an ``error`` event → failed (``error``): the root-cause rank's own, else the first;
8. torchrun saw a rank exit with an error code first → failed (``exit``);
9. the torchrun agent was killed by a signal → failed (``agent``);
10. the rendezvous port was taken → failed (``port``);
11. anything else → failed (``unknown``), with what torchrun's error files or its log say.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from homelab_dp.runs.folder.run_state import diagnose, signal_name, torchrun_root_cause
from homelab_dp.runs.run_events import CheckpointEvent, EndEvent, ErrorEvent, Event, StepEvent
from homelab_dp.supervise.watchdog import Stall


@dataclass(frozen=True)
class Verdict:
    """How a launch ended: the run's final status, the reason, and the failure record."""

    status: str
    """completed | interrupted | failed."""
    reason: str
    failure: dict[str, Any] | None = None
    """For a failed run: ``kind`` (stall | agent | oom | signal | error | exit | port | unknown)
    and its details (rank, pid, signal, proposal, …), for programs (``--auto-fit`` reads it)."""


@dataclass(frozen=True)
class Attempt:
    """What one launch left behind: the verdict's inputs, plain data the keeper gathers."""

    exit_code: int | None
    """torchrun's exit code; negative when the agent was killed by that signal."""
    events: Sequence[Event] = ()
    """This launch's events (a resumed run appends to the same events.jsonl)."""
    log_text: str = ""
    """``logs/launcher.log`` from this launch on: torchrun's output and the ranks'."""
    launcher_log: str = "logs/launcher.log"
    """Where that log is, named in a diagnosis."""
    stop_requested: bool = False
    stall: Stall | None = None
    """The watchdog's finding when it ended the run."""
    orphans: Sequence[int] = ()
    """Workers still alive after the agent exited (the keeper stopped them)."""
    nnodes: int = 1
    error_files: Sequence[tuple[str, dict[str, Any]]] = ()
    """torchrun's error files: (path, parsed contents)."""

    @property
    def agent_signal(self) -> str | None:
        """The signal that killed the torchrun agent ("SIGKILL"), or None."""
        if self.exit_code is None or self.exit_code >= 0:
            return None
        return signal_name(-self.exit_code)


def decide(a: Attempt) -> Verdict:
    """The verdict on a launch; the branches are listed in the module docstring."""
    if a.stall is not None:
        return _stalled(a.stall)
    ends = [e for e in a.events if isinstance(e, EndEvent)]
    errors = [e for e in a.events if isinstance(e, ErrorEvent)]
    end = ends[-1] if ends else None
    whole = end is not None and bool(end.final_path)  # written after final/ was whole
    if end is not None and end.reason == "completed" and (a.exit_code == 0 or
                                                          (whole and a.stop_requested)):  # fmt: skip
        return Verdict("completed", f"{end.steps} steps, result in final/")
    if end is not None and end.reason == "early_stopped" and a.exit_code == 0:
        return Verdict("completed", f"early stopped at step {end.steps} (the eval loss stopped "
                       "improving), result in final/")  # fmt: skip
    if end is not None and end.reason == "stopped" and not errors:
        return _stopped(a, end)
    if a.stop_requested:
        return _requested(a, end, errors)
    if a.exit_code == 0 and not ends and a.nnodes > 1:
        # c10d hands out global ranks in joining order: rank 0 (events, checkpoints'
        # metadata, the result) may live on another node's run folder.
        return Verdict("completed", "this node's workers finished; rank 0 ran on another node")
    return _failed(a, errors)


def _stalled(s: Stall) -> Verdict:
    failure = {"kind": "stall", "rank": s.rank, "pid": s.pid, "step": s.step,
               "idle_s": round(s.idle_s, 1)}  # fmt: skip
    return Verdict("failed", f"stalled: {s.message}; the watchdog ended the run", failure)


def _stopped(a: Attempt, end: EndEvent) -> Verdict:
    """Every rank stopped at a step boundary with a checkpoint: why?"""
    at = f"stopped at step {end.steps} with a checkpoint"
    if a.agent_signal and not a.stop_requested:
        return Verdict(
            "failed",
            f"the torchrun agent was killed by {a.agent_signal}; the keeper stopped its workers "
            f"({at}); resume with `homelab-dp resume`",
            {"kind": "agent", "signal": a.agent_signal, "orphans": list(a.orphans)},
        )
    return Verdict("interrupted", f"{_stop_cause(a)}: {at}; resume with `homelab-dp resume`")


def _requested(a: Attempt, end: EndEvent | None, errors: list[ErrorEvent]) -> Verdict:
    """A stop was requested and the ranks did not all stop at a step boundary: the stop came
    during start-up, before a rank's own handler was in place, or while the ranks were
    leaving, and a rank died of the SIGTERM or of a peer that did. The user asked for it: an
    interrupted run, whatever the ranks' exits say; only running out of memory is its own
    failure."""
    oom = [e for e in errors if e.kind == "OutOfMemoryError"]
    if oom:
        return _failed(a, errors)
    steps = [e.step for e in a.events if isinstance(e, StepEvent)]
    if end is not None and end.reason in ("completed", "early_stopped"):
        at = f"after its last step ({end.steps}), before the result was whole"
    elif steps:
        at = f"at step {max(steps)}, before a checkpoint of it"
    else:
        at = "during start-up, before its first step"
    checkpoints = [e.step for e in a.events if isinstance(e, CheckpointEvent)]
    kept = f"its checkpoint of step {max(checkpoints)} is kept" if checkpoints else (
        "it resumes from its newest checkpoint, if any")  # fmt: skip
    return Verdict("interrupted", f"stopped by request {at}; {kept}; resume with "
                   "`homelab-dp resume`")  # fmt: skip


def _stop_cause(a: Attempt) -> str:
    if a.stop_requested:
        return "stopped by request"
    received = re.findall(r"Received (\d+) death signal", a.log_text)
    if received:
        return f"the torchrun agent received {signal_name(int(received[-1]))}"
    return "stopped"


def _failed(a: Attempt, errors: list[ErrorEvent]) -> Verdict:
    """The root cause of a failed launch (branches 5 to 11)."""
    root = torchrun_root_cause(a.log_text)
    oom = [e for e in errors if e.kind == "OutOfMemoryError"]
    if oom:  # the rank that ran out of memory, with its proposal; its peers only echo it
        e = oom[0]
        return Verdict(
            "failed",
            f"rank {_rank(e)}: {e.message}",
            {"kind": "oom", "rank": e.rank, "proposal": e.proposal, "hint": e.hint},
        )
    if root is not None and root.signal:
        return Verdict(
            "failed",
            root.describe(),
            {"kind": "signal", "rank": root.rank, "pid": root.pid, "signal": root.signal},
        )
    if errors:  # the root-cause rank's own error event, else the first one
        mine = [e for e in errors if root is not None and e.rank == root.rank]
        e = (mine or errors)[0]
        # A checkpoint write failure names its own rank (DCP gathers every rank's failure).
        who = "" if e.kind == "CheckpointError" else f"rank {_rank(e)}: "
        return Verdict(
            "failed",
            who + (e.message or "error"),
            {"kind": "error", "rank": e.rank, "error": e.kind or None, "hint": e.hint},
        )
    if root is not None:
        return Verdict(
            "failed",
            root.describe(),
            {"kind": "exit", "rank": root.rank, "exitcode": root.exitcode},
        )
    if a.agent_signal:
        return Verdict(
            "failed",
            f"the torchrun agent was killed by {a.agent_signal}",
            {"kind": "agent", "signal": a.agent_signal, "orphans": list(a.orphans)},
        )
    if "address already in use" in a.log_text:
        port = re.search(r"(\d+\.\d+\.\d+\.\d+:\d+): address already in use", a.log_text)
        where = port.group(1) if port else "the rendezvous port"
        return Verdict(
            "failed", f"{where} is already in use: the rendezvous could not start", {"kind": "port"}
        )
    diagnosis = diagnose(a.log_text, a.error_files, a.launcher_log)
    return Verdict(
        "failed", diagnosis or f"torchrun exited with code {a.exit_code}", {"kind": "unknown"}
    )


def _rank(e: ErrorEvent) -> str:
    return "?" if e.rank is None else str(e.rank)
