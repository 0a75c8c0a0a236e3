"""A run's `state.json`: status, pids, exit reason — and the truth when its writer died.

`state.json` is written by the controller at start and by the keeper (the supervisor that
outlives the terminal) at the end. When every recorded process is gone but the file still
says starting/running/stopping, the run ended without saying so: `current_state` then settles
it from what it left (`settled_state`): completed when this launch's end event says so and
final/ is there (the keeper was killed as the run finished), interrupted when a stop was
requested, else failed with the reason read from torchrun's error files and the logs. A queued run whose
keeper is gone (a reboot) reads as interrupted, with ``queued_only`` set: nothing had started.

The reason names the root cause: torchrun's summary lists every rank that failed, and the
"Root Cause (first observed failure)" block says which went first and how (exit code, or the
signal that killed it); `torchrun_root_cause` reads it, so a SIGKILLed rank is not mistaken
for the "connection reset" of the peers that were left waiting for it. The reading of
torchrun's output (`torchrun_root_cause`, `diagnose`) lives here, below the run layer, because
both this fallback and the keeper's verdict (`homelab_dp.supervise.launch_verdict`) use it. A failed run's
state.json also holds ``failure``: {kind (signal | stall | oom | error | agent | exit | port |
unknown), rank, …} for programs (``--auto-fit`` reads the out-of-memory proposal from it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from homelab_dp.runs.folder.run_folder import write_json_atomic
from homelab_dp.vocabulary import ACTIVE_STATUSES, FINAL_STATUSES

ACTIVE = ACTIVE_STATUSES
FINAL = FINAL_STATUSES
LIVE = (*ACTIVE_STATUSES, "queued")
"""Not ended yet: active, or waiting in the queue (a follower keeps following)."""


def read_state(run_dir: Path) -> dict[str, Any]:
    """The raw state.json (an empty "unknown" state when it is missing or unreadable)."""
    try:
        state = json.loads((run_dir / "state.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):  # missing, not JSON, not UTF-8
        return {"status": "unknown", "pids": {}}
    if not isinstance(state, dict) or not isinstance(state.get("pids") or {}, dict):
        return {"status": "unknown", "pids": {}}  # damaged: it tells nothing
    return state


def update_state(run_dir: Path, **changes: Any) -> dict[str, Any]:
    """Merge ``changes`` into state.json (pids are merged key by key). Every pid recorded is
    recorded with its start time (``starts``: {pid: start}, `process_start`), so a pid the system
    has since given to another process is never taken for the run's (`is_run_process`)."""
    state = read_state(run_dir)
    if state.get("status") == "unknown" and "status" not in changes:
        changes["status"] = "starting"
    pids = dict(state.get("pids") or {})
    pids.update(changes.pop("pids", {}) or {})
    state.update(changes)
    state["pids"] = pids
    recorded = state.get("starts") if isinstance(state.get("starts"), dict) else {}
    starts = {str(p): recorded[str(p)] for p in _pids_of(pids) if str(p) in recorded}
    for pid in _pids_of(pids):
        if str(pid) not in starts:
            start = process_start(pid)
            if start is not None:
                starts[str(pid)] = start
    state["starts"] = starts
    state["updated"] = time.time()
    write_json_atomic(run_dir / "state.json", state)
    return state


def _stat_after_name(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (field 3, the state, comes first),
    or None when there is no such process (or no /proc). The name (field 2) may hold spaces and
    parentheses, so the line is split after its last ")"."""
    try:
        with open(f"/proc/{int(pid)}/stat", encoding="ascii", errors="replace") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def process_start(pid: int) -> int | None:
    """When the process ``pid`` started (clock ticks since boot: field 22 of /proc/PID/stat),
    or None when there is no such process (or no /proc). With the pid, it names one process:
    a pid is reused, a (pid, start) pair is not."""
    fields = _stat_after_name(pid)
    try:
        return int(fields[19]) if fields else None
    except (ValueError, IndexError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{int(pid)}/cmdline", "rb") as fh:
            return fh.read().replace(bytes(1), b" ").decode("utf-8", errors="replace")
    except OSError:
        return ""


def is_run_process(state: dict[str, Any], pid: int, run_dir: Path | None = None) -> bool:
    """Whether ``pid`` is alive and still the process the run recorded: the same start time as
    recorded; for a pid recorded without one (state files of older versions), a command line
    that is homelab-dp's or names the run (its folder or id). Never signal a pid without this."""
    if not pid_alive(pid):
        return False
    starts = state.get("starts") if isinstance(state.get("starts"), dict) else {}
    recorded = starts.get(str(pid))
    if recorded is not None:
        return process_start(pid) == recorded
    cmdline = _cmdline(pid)
    names = ["homelab_dp", "homelab-dp"]
    if run_dir is not None:
        names += [str(run_dir), run_dir.name]
    elif state.get("run_id"):
        names.append(str(state["run_id"]))
    return any(name and name in cmdline for name in names)


def signal_run_process(
    state: dict[str, Any], pid: int, sig: int, run_dir: Path | None = None
) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the run's process (`is_run_process`); whether
    it was sent. A pid that now belongs to another process is left alone."""
    if not is_run_process(state, pid, run_dir):
        return False
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def pid_alive(pid: int | None) -> bool:
    """Whether a process with this pid exists and is not a zombie."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = _stat_after_name(pid)  # a zombie has exited; only its parent has not reaped it yet
    return not fields or fields[0] != "Z"


def _pids_of(pids: dict[str, Any]) -> list[int]:
    out = [pids.get(k) for k in ("keeper", "agent", "monitor")]
    workers = pids.get("workers")
    out += list(workers) if isinstance(workers, list) else []
    return [p for p in out if isinstance(p, int) and not isinstance(p, bool) and p > 0]


def recorded_pids(state: dict[str, Any]) -> list[int]:
    """Every pid the state records: keeper, agent, monitor and workers."""
    return _pids_of(state.get("pids") or {})


def alive_pids(state: dict[str, Any], run_dir: Path | None = None) -> list[int]:
    """The recorded pids that are alive and still the run's processes (`is_run_process`)."""
    return [p for p in recorded_pids(state) if is_run_process(state, p, run_dir)]


def current_state(run_dir: Path) -> dict[str, Any]:
    """state.json, corrected when the run's processes are gone without a final status."""
    state = read_state(run_dir)
    if state.get("status") == "queued" and not _keeper_alive(state, run_dir):
        state = read_state(run_dir)  # the keeper may have moved on between the two reads
        if state.get("status") == "queued" and not _keeper_alive(state, run_dir):
            state["status"] = "interrupted"
            state["queued_only"] = True
            state["reason"] = (f"its keeper died while it was queued (a reboot?); nothing was "
                               f"started; `homelab-dp resume {run_dir.name}` queues it again")  # fmt: skip
        return state
    if state.get("status") in ACTIVE and not alive_pids(state, run_dir):
        # Re-read: the keeper may have written the final state between the two reads.
        state = read_state(run_dir)
        if state.get("status") in ACTIVE and not alive_pids(state, run_dir):
            state.update(settled_state(run_dir, state))
    return state


DIED = "its keeper died before writing the final state"


def settled_state(run_dir: Path, state: dict[str, Any]) -> dict[str, Any]:
    """The final status of a run whose processes are all gone while state.json still says it is
    active (its keeper was killed, or the machine went down), from what the run left:

    - rank 0's ``end`` event of this launch says completed (or early stopped) and names the
      result, and ``final/`` is there → completed (the end event is written after ``final/``
      is whole, merge included);
    - a stop was requested (`stop` marks ``stop_requested`` before it signals) → interrupted,
      stopped by request, whenever it landed (before the keeper's own handler, during start-up);
    - otherwise → failed, with the root cause the logs show.

    Returns the fields to merge: ``status``, ``reason`` (and ``failure`` None when not failed)."""
    end = _launch_end(run_dir)
    if end is not None and end.get("reason") in ("completed", "early_stopped"):
        final = end.get("final_path")
        if isinstance(final, str) and final and (run_dir / "final").is_dir():
            steps = end.get("steps")
            how = "early stopped" if end.get("reason") == "early_stopped" else "completed"
            return {"status": "completed", "failure": None,
                    "reason": f"{steps} steps ({how}), result in final/; {DIED}"}  # fmt: skip
    if state.get("stop_requested"):
        at = f" at step {end.get('steps')}" if end is not None else ""
        return {"status": "interrupted", "failure": None,
                "reason": f"stopped by request{at}; {DIED}; resume with "
                f"`homelab-dp resume {run_dir.name}`"}  # fmt: skip
    why = diagnose_failure(run_dir) or "its processes are gone"
    return {"status": "failed", "reason": "the run's processes died without a final state: " + why}


MAX_EVENTS_READ = 64 * 1024 * 1024
"""The most bytes of events.jsonl read to settle a dead run (its tail: the last launch)."""


def _launch_end(run_dir: Path) -> dict[str, Any] | None:
    """This launch's ``end`` event: the last one in events.jsonl when no launch ("starting"
    state event) came after it; None when the last launch never ended."""
    try:
        with open(run_dir / "events.jsonl", "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - MAX_EVENTS_READ))
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            doc = json.loads(line)
        except (ValueError, RecursionError):  # a torn line, not UTF-8, hostile nesting
            continue
        if not isinstance(doc, dict):
            continue
        if doc.get("type") == "end":
            return doc
        if doc.get("type") == "state" and doc.get("status") in ("starting", "queued"):
            return None  # a launch began after any end before it
    return None


def _keeper_alive(state: dict[str, Any], run_dir: Path | None = None) -> bool:
    """A queued run's keeper is alive (it is the only process a queued run has)."""
    keeper = (state.get("pids") or {}).get("keeper")
    # Just created, keeper not recorded yet: the controller writes its pid right after spawning.
    if not keeper:
        return time.time() - float(state.get("updated") or 0) < 10
    return is_run_process(state, int(keeper), run_dir)


_SIGNAL_RE = re.compile(r"[Ss]ignal (\d+) \((SIG\w+)\)|exitcode\s*:\s*(-?\d+)")
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):(.*?)(?:\n={8,}|\Z)", re.S)


@dataclass(frozen=True)
class RankFailure:
    """The first failure torchrun observed: which rank, and its exit code or signal."""

    rank: int | None
    exitcode: int | None
    pid: int | None
    signal: str | None
    """"SIGKILL" when the rank was killed by a signal, else None."""

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "a rank"
        pid = f" (pid {self.pid})" if self.pid else ""
        if self.signal:
            num = int(signal.Signals[self.signal])
            return f"{who}{pid} was killed by signal {self.signal} ({num})"
        return f"{who}{pid} exited with code {self.exitcode}"


def _parse_failure(block: str) -> RankFailure:
    """One entry of torchrun's summary ("rank : 1 (local_rank: 1)", "exitcode : -9 (pid: …)")."""
    rank = re.search(r"rank\s*:\s*(\d+)", block)
    code = re.search(r"exitcode\s*:\s*(-?\d+)(?:\s*\(pid:\s*(\d+)\))?", block)
    exitcode = int(code.group(1)) if code else None
    sig = signal_name(-exitcode) if exitcode is not None and exitcode < 0 else None
    return RankFailure(
        rank=int(rank.group(1)) if rank else None,
        exitcode=exitcode,
        pid=int(code.group(2)) if code and code.group(2) else None,
        signal=sig,
    )


def torchrun_root_cause(text: str) -> RankFailure | None:
    """The rank that brought the run down, from the last summary torchrun printed.

    torchrun's "Root Cause" is its *first observed* failure, and observation order is not cause
    order: when one rank is SIGKILLed, a peer may abort (SIGABRT from gloo, or exit 1) and be
    observed first. A rank killed by SIGKILL is killed from outside (a user, the OOM killer,
    the watchdog) and never as an echo of a peer, so among the summary's failures it is the
    cause; otherwise torchrun's root cause stands.
    """
    blocks = _ROOT_CAUSE.findall(text)
    if not blocks:
        return None
    root = _parse_failure(blocks[-1])
    summary = text[: text.rindex("Root Cause (first observed failure):")]
    listed = summary[summary.rfind("Failures:") :] if "Failures:" in summary else ""
    others = [_parse_failure(b) for b in re.split(r"\n\s*\[\d+\]:", listed)[1:]]
    if root.signal != "SIGKILL":
        killed = [f for f in others if f.signal == "SIGKILL"]
        if killed:
            return killed[0]
    return root


def read_log_since(path: Path, offset: int = 0) -> str:
    """The text of a log file from byte ``offset`` (this launch's part of an appended log)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(offset)
            return fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def diagnose_failure(run_dir: Path, since: int = 0) -> str | None:
    """Which rank failed and how, from torchrun's summary, its error files and the logs."""
    launcher_log = run_dir / "logs" / "launcher.log"
    text = read_log_since(launcher_log, since)
    return diagnose(text, read_error_files(run_dir), str(launcher_log))


def read_error_files(run_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """torchrun's error files under ``logs/`` (path, parsed contents); unreadable ones skipped."""
    found = []
    for err_file in sorted((run_dir / "logs").rglob("error.json")):
        try:
            doc = json.loads(err_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        if isinstance(doc, dict):
            found.append((str(err_file), doc))
    return found


def diagnose(
    text: str, error_files: Sequence[tuple[str, dict[str, Any]]], launcher_log: str
) -> str | None:
    """Which rank failed and how: torchrun's root cause in the launcher log ``text``, else the
    first error file's message, else the last signal or exit code the log mentions."""
    root = torchrun_root_cause(text)
    if root is not None:
        return f"{root.describe()} (see {launcher_log})"
    for err_file, doc in error_files:
        message = doc.get("message")
        if isinstance(message, dict):
            message = message.get("message")
        rank = re.search(r"rank_?(\d+)|/(\d+)/error.json", err_file)
        where = f"rank {next(g for g in rank.groups() if g)}" if rank else err_file
        first = str(message or "").strip().splitlines()
        return f"{where}: {first[-1] if first else 'error'} (see {err_file})"
    if text:
        text = text[-20000:]
        found = _SIGNAL_RE.findall(text)
        ranks = re.findall(r"rank\s*:\s*(\d+)", text)
        if found:
            num, name, code = found[-1]
            how = f"signal {name} ({num})" if name else _describe_exit(int(code))
            rank = f"rank {ranks[-1]}: " if ranks else ""
            return f"{rank}{how} (see {launcher_log})"
    return None


def _describe_exit(code: int) -> str:
    if code < 0:
        name = signal_name(-code)
        return name if name.startswith("signal ") else f"signal {name} ({-code})"
    return f"exit code {code}"


def signal_name(num: int) -> str:
    """``9`` → "SIGKILL" ("signal 99" for a number that is no signal)."""
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"
