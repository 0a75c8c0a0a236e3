"""The keeper: the small supervisor that owns one run and outlives the terminal.

``python -m homelab_dp.supervise.keeper RUN_DIR`` is started by the controller in a new session with
its output in ``logs/keeper.log`` (never a pipe to a terminal). It starts torchrun and the
device monitor, records every pid in ``state.json``, forwards a graceful stop to the workers,
waits for torchrun, and writes the final status with the reason. It guarantees three things:

- **No orphans.** When the torchrun agent dies (even by SIGKILL) its workers — which run in
  sessions of their own — are stopped gracefully (they checkpoint), then killed after a grace
  period. (The workers also notice by themselves: `homelab_dp.train.loop.rank_guard`.)
- **No hang.** A watchdog (`homelab_dp.supervise.watchdog`, limit ``train.watchdog_s``) ends a run
  whose ranks all stopped making progress, naming the rank that stalled. A rank that dies is
  seen by torchrun at once, and its peers' collectives fail on the closed connection or after
  ``train.collective_timeout_s``.
- **The true reason.** The final status names the root cause, not its echo: the rank torchrun
  saw fail first and its signal, an out-of-memory proposal, or the stall — never the
  "connection reset" of the ranks that were left waiting. Only this launch's events and log
  lines count (a resumed run appends to the same files). The keeper gathers them; the verdict
  itself is a pure function of them (`homelab_dp.supervise.launch_verdict`).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from homelab_dp.errors import HomelabError
from homelab_dp.planning.speed_calibration import record_speed
from homelab_dp.runs import run_queue as queue
from homelab_dp.runs.folder.heartbeats import heartbeat_dir
from homelab_dp.runs.folder.jsonl_tail import JsonlTail, file_size
from homelab_dp.runs.folder.run_folder import append_event, read_run_spec
from homelab_dp.runs.folder.run_state import (
    alive_pids,
    current_state,
    is_run_process,
    pid_alive,
    read_error_files,
    read_log_since,
    read_state,
    signal_run_process,
    update_state,
)
from homelab_dp.runs.preset_results import record_run
from homelab_dp.runs.run_events import ErrorEvent, Event, RetryEvent, StateEvent, parse_event
from homelab_dp.runs.run_view import summarize, view_of
from homelab_dp.supervise import launcher, notifier
from homelab_dp.supervise.launch_verdict import Attempt, Verdict, decide
from homelab_dp.supervise.relaunch import MAX_OOM_RETRIES, apply_oom_proposal
from homelab_dp.supervise.watchdog import Stall, Watchdog
from homelab_dp.vocabulary import ACTIVE_STATUSES, FINAL_STATUSES

WORKER_GRACE_S = 20.0
"""How long orphaned workers get to exit after SIGTERM before SIGKILL."""
AGENT_GRACE_S = 15.0
"""How long torchrun gets to exit after the watchdog killed its stalled workers."""
QUEUE_POLL_S = 1.5
"""How often a queued run looks whether its devices are free."""


class Keeper:
    """Supervises one launch (a fresh start or a resume) of a run."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.spec = read_run_spec(run_dir)
        self.agent: subprocess.Popen | None = None
        self.monitor: subprocess.Popen | None = None
        self.stop_requested = False
        self.stall: Stall | None = None
        self.orphans: list[int] = []
        self.exit_code: int | None = None
        # This launch's part of the append-only files (a resume appends to the same ones).
        self.events = JsonlTail(run_dir / "events.jsonl", file_size(run_dir / "events.jsonl"))
        self.log_from = file_size(run_dir / "logs" / "launcher.log")
        self.watchdog = Watchdog(run_dir, float(self.spec.preset.train.watchdog_s))
        self.attempt_events: list[Event] = []

    # -------------------------------------------------------------- processes
    def _start_monitor(self) -> subprocess.Popen:
        log = open(self.run_dir / "logs" / "monitor.log", "ab")  # noqa: SIM115 - child owns it
        return subprocess.Popen(
            [sys.executable, "-m", "homelab_dp.supervise.device_monitor", str(self.run_dir)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def worker_pids(self) -> list[int]:
        """The torchrun agent's worker processes (they run in sessions of their own)."""
        if self.agent is None:
            return []
        try:
            children = psutil.Process(self.agent.pid).children(recursive=False)
        except psutil.NoSuchProcess:
            return list(read_state(self.run_dir).get("pids", {}).get("workers") or [])
        return [c.pid for c in children if "homelab_dp.train.loop.worker" in " ".join(_cmdline(c))]

    def request_stop(self, signum: int = signal.SIGTERM, frame: Any = None) -> None:
        """Graceful stop: every worker gets SIGTERM; the ranks agree, checkpoint and exit."""
        # The supervision loop sends each worker one SIGTERM: a second one could land while a
        # rank is already shutting down with the default handler back in place.
        self.stop_requested = True
        try:  # `stop` marked it already; a full disk must not end the keeper in its handler
            update_state(self.run_dir, status="stopping", reason="stop requested",
                         stop_requested=time.time())  # fmt: skip
        except OSError as exc:
            print(f"keeper: the stop was not recorded in state.json ({exc})", file=sys.stderr)

    # -------------------------------------------------------------- lifecycle
    def run(self) -> int:
        """Launch, supervise, and write the final state; the keeper's exit code."""
        return self.finish(self.launch_and_wait())

    def launch_and_wait(self) -> Verdict:
        """Start torchrun and the monitor, supervise until torchrun exits; the verdict."""
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        shutil.rmtree(heartbeat_dir(self.run_dir), ignore_errors=True)  # an earlier launch's
        state = update_state(self.run_dir, status="starting", pids={"keeper": os.getpid()})
        if state.get("stop_requested"):  # `stop` came before this handler was in place
            self.stop_requested = True
            return Verdict("interrupted", "stopped by request before it started; resume with "
                           "`homelab-dp resume`")  # fmt: skip
        self.agent = launcher.launch(self.run_dir)
        self.monitor = self._start_monitor()
        update_state(
            self.run_dir,
            status="running",
            pids={"agent": self.agent.pid, "monitor": self.monitor.pid},
        )
        recorded = self._supervise()
        rc = self.agent.returncode
        state = read_state(self.run_dir)  # the start times recorded with the workers' pids
        self.orphans = [p for p in recorded if is_run_process(state, p, self.run_dir)]
        self._end_orphans(self.orphans)
        self._stop_monitor()
        self.exit_code = rc
        return self.final_status(rc)

    def finish(self, verdict: Verdict) -> int:
        """Write the final state and event of the run (a completed run's results first)."""
        final = {"status": verdict.status, "reason": verdict.reason, "ended": time.time()}
        if verdict.status == "completed":  # before the state says so: a follower then finds it
            self._record_results(final)
        update_state(self.run_dir, **final, exit_code=self.exit_code, failure=verdict.failure)
        append_event(self.run_dir, StateEvent(status=verdict.status, reason=verdict.reason))
        return 0 if verdict.status in ("completed", "interrupted") else 1

    def _record_results(self, final: dict[str, Any]) -> None:
        record_results(self.run_dir, final)

    def _supervise(self) -> list[int]:
        """Poll until torchrun exits: record workers, forward a stop, run the watchdog."""
        assert self.agent is not None
        recorded: list[int] = []
        signalled: set[int] = set()
        killed_at: float | None = None
        while self.agent.poll() is None:
            new = [p for p in self.worker_pids() if p not in recorded]
            if new:  # record every worker ever seen; exited ones stay for the post-mortem
                recorded += new
                update_state(self.run_dir, pids={"workers": recorded})
            if self.stop_requested and self.stall is None:  # also reaches late workers
                for pid in set(recorded) - signalled:
                    self._signal(pid, signal.SIGTERM)
                signalled.update(recorded)
            if self.stall is None:
                stall = self.watchdog.check()
                if stall is not None:
                    self._end_stalled(stall, recorded)
                    killed_at = time.monotonic()
            elif killed_at is not None and time.monotonic() - killed_at > AGENT_GRACE_S:
                self.agent.kill()  # torchrun itself is stuck: nothing else will end it
            time.sleep(0.2)
        return recorded

    def _end_stalled(self, stall: Stall, workers: list[int]) -> None:
        """A stalled run cannot stop gracefully (that needs every rank): kill its workers."""
        self.stall = stall
        update_state(self.run_dir, status="stopping", reason=f"stalled: {stall.message}")
        append_event(
            self.run_dir,
            ErrorEvent(kind="Stall", rank=stall.rank, message=f"stalled: {stall.message}"),
        )
        for pid in workers:  # SIGKILL also ends a stopped (SIGSTOP) process; SIGTERM would wait
            self._signal(pid, signal.SIGKILL)

    def _end_orphans(self, alive: list[int]) -> None:
        """Workers still alive after the agent is gone (agent killed): stop them, then kill."""
        for pid in alive:
            self._signal(pid, signal.SIGTERM)
        deadline = time.time() + WORKER_GRACE_S
        while alive and time.time() < deadline:
            time.sleep(0.2)
            alive = [p for p in alive if pid_alive(p)]
        for pid in alive:
            self._signal(pid, signal.SIGKILL)

    def _signal(self, pid: int, sig: int) -> None:
        """Signal a recorded worker, only while it is still that worker (its pid and start
        time as recorded in state.json): a pid reused by another process is left alone."""
        signal_run_process(read_state(self.run_dir), pid, sig, self.run_dir)

    def _stop_monitor(self) -> None:
        if self.monitor is not None and self.monitor.poll() is None:
            self.monitor.terminate()
            try:
                self.monitor.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.monitor.kill()
                self.monitor.wait()

    # -------------------------------------------------------------- verdict
    def final_status(self, rc: int | None) -> Verdict:
        """The verdict on this launch (`homelab_dp.supervise.launch_verdict`), from what it left behind."""
        for doc in self.events.read():
            event = parse_event(doc)
            if event is not None:
                self.attempt_events.append(event)
        launcher_log = self.run_dir / "logs" / "launcher.log"
        attempt = Attempt(
            exit_code=rc,
            events=self.attempt_events,
            log_text=read_log_since(launcher_log, self.log_from),
            launcher_log=str(launcher_log),
            stop_requested=self.stop_requested,
            stall=self.stall,
            orphans=self.orphans,
            nnodes=self.spec.launch.rendezvous.nnodes,
            error_files=read_error_files(self.run_dir),
        )
        return decide(attempt)


def record_results(run_dir: Path, final: dict[str, Any]) -> None:
    """Record a completed run's figures against its preset (`homelab_dp.runs.preset_results`),
    and its steady speed for the time model's calibration (`record_speed`: the next plan on
    this machine prices compute at what this run achieved)."""
    try:
        record = record_run(run_dir, final) or {}
        measured = record.get("measured") or {}
        if measured.get("tokens_per_s"):
            plan = read_run_spec(run_dir).plan
            record_speed(plan, tokens_per_s=measured["tokens_per_s"], source="run",
                         run_id=str(record.get("run_id") or ""),
                         step_seconds=measured.get("step_seconds"),
                         compute_seconds=measured.get("compute_seconds"))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - the run is over: recording never changes that
        print(f"keeper: the run's results were not recorded: {exc!r}", file=sys.stderr)


SETTLED = ".settled-{attempt}"
"""The claim a reader takes to settle a launch whose keeper died (one reader wins)."""


def settle_dead_run(run_dir: Path) -> bool:
    """The keeper's last word, said by whoever reads the run first once its keeper is dead:
    when state.json still says the run is active, its keeper's pid is recorded and gone, and
    none of its processes lives, the status `current_state` reads from what the run left
    (`runs.folder.run_state.settled_state`: completed from the end event and final/,
    interrupted for a requested stop, else failed) is written as the final state, with its
    state event and, for a completed run, its recorded results; then its benchmarks and its
    notification run once, in a process of their own (``keeper --after-end``). One reader
    settles a launch (an O_EXCL claim file); True when this call did."""
    state = read_state(run_dir)
    keeper = (state.get("pids") or {}).get("keeper")
    if state.get("status") not in ACTIVE_STATUSES or not isinstance(keeper, int) or keeper <= 0:
        return False  # not started by a keeper yet, or ended as it should
    if alive_pids(state, run_dir):
        return False
    settled = current_state(run_dir)
    if settled.get("status") not in FINAL_STATUSES:
        return False
    claim = run_dir / SETTLED.format(attempt=int(state.get("attempt") or 1))
    try:
        os.close(os.open(claim, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        return False  # another reader settled it
    except OSError:
        return False  # a read-only or full run folder: readers still see the settled status
    final = {"status": settled["status"], "reason": settled.get("reason"), "ended": time.time()}
    try:
        if final["status"] == "completed":
            record_results(run_dir, final)
        update_state(run_dir, **final, failure=settled.get("failure"), settled_after_keeper=True)
        append_event(run_dir, StateEvent(status=final["status"], reason=final["reason"]))
    except OSError:
        return False  # the disk is full: `current_state` keeps reading it settled
    try:
        log = open(run_dir / "logs" / "keeper.log", "ab")  # noqa: SIM115 - the child owns it
    except OSError:  # a folder that lost its logs/: the benchmarks and notification still run
        log = open(os.devnull, "ab")  # noqa: SIM115
    with log:
        subprocess.Popen(
            [sys.executable, "-m", "homelab_dp.supervise.keeper", "--after-end", str(run_dir)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=run_dir,
        )  # fmt: skip
    return True


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def wait_in_queue(run_dir: Path) -> bool:
    """Wait until the queue lets this run start (`homelab_dp.runs.run_queue.waiting`); then set it
    "starting" and return True. A stop request while waiting ends the run as interrupted with
    nothing started, and returns False."""

    stopped: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    signal.signal(signal.SIGINT, lambda signum, frame: stopped.append(signum))
    update_state(run_dir, pids={"keeper": os.getpid()})
    spec = read_run_spec(run_dir)
    devices = queue.devices_of(spec)
    created = float(read_state(run_dir).get("created") or time.time())
    need = spec.planned_bytes.get("total")
    shown: dict[str, Any] | None = None
    while not stopped:
        if read_state(run_dir).get("stop_requested"):  # `stop` marks it (run_queue.leave_queue)
            stopped.append(signal.SIGTERM)
            break
        others = queue.others(run_dir.parent, run_dir.name)
        now = queue.waiting(run_dir.name, created, devices, others)
        if not now.waiting_for and not devices.cpu and need:  # probe only when it is our turn
            free = queue.free_memory(devices.indices, devices.uuids)
            now = queue.waiting(run_dir.name, created, devices, others, free, need)
        if not now.waiting_for:
            break
        if now.to_json() != shown:  # `status` reads what the keeper waits for
            shown = now.to_json()
            update_state(run_dir, queue=shown)
        time.sleep(QUEUE_POLL_S)
    if stopped:
        reason = queue.STOPPED_QUEUED
        update_state(
            run_dir,
            status="interrupted",
            reason=reason,
            ended=time.time(),
            queue=None,
            queued_only=True,
        )
        append_event(run_dir, StateEvent(status="interrupted", reason=reason))
        return False
    update_state(run_dir, status="starting", reason=None, queue=None, started=time.time(),
                 stop_requested=None)  # fmt: skip
    append_event(run_dir, StateEvent(status="starting", reason="its turn in the queue"))
    return True


def after_end(run_dir: Path) -> None:
    """Once the run's final state is written: a completed run's benchmarks
    (``train.bench_tasks``), then the user's notification, once (`homelab_dp.supervise.notifier`).
    Neither changes the run's state; their failures are logged."""
    try:
        spec = read_run_spec(run_dir)
    except (OSError, ValueError, KeyError, HomelabError) as exc:
        notifier.log(f"no benchmarks or notification: the run spec is not readable ({exc})")
        return
    state = read_state(run_dir)
    status = str(state.get("status"))
    if status == "completed" and spec.preset.train.bench_tasks:
        notifier.run_bench(
            run_dir,
            list(spec.preset.train.bench_tasks),
            trust_code=spec.preset.train.bench_trust_code,
        )
    command = spec.notify or notifier.configured_command()
    if not command:
        return
    try:
        figures = summarize(run_dir, view_of(run_dir), state)
    except (OSError, ValueError, KeyError, TypeError, HomelabError) as exc:
        notifier.log(f"the run's figures are not readable ({exc}); the summary has none")
        figures = {}
    notifier.notify(command, run_dir, status, notifier.summary_line(run_dir.name, state, figures))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="homelab-dp run keeper (started by the controller)"
    )
    parser.add_argument("run_dir", type=Path, help="the run folder; its spec.json says the rest")
    parser.add_argument("--after-end", action="store_true",
                        help="only the ended run's benchmarks and notification (`settle_dead_run`)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.after_end:
        after_end(args.run_dir)
        return 0
    return supervise(args.run_dir)


def supervise(run_dir: Path) -> int:
    """Run the launch; with ``auto_fit`` in the spec, resume after out-of-memory with the
    worker's proposal (same effective batch), up to `MAX_OOM_RETRIES` times. A queued run
    first waits for its turn (`wait_in_queue`)."""

    if read_state(run_dir).get("status") == "queued" and not wait_in_queue(run_dir):
        after_end(run_dir)
        return 0
    retries = 0
    while True:
        keeper = Keeper(run_dir)
        verdict = keeper.launch_and_wait()
        change = None
        wanted = keeper.spec.auto_fit and not keeper.stop_requested
        if verdict.failure and wanted and retries < MAX_OOM_RETRIES:
            change = apply_oom_proposal(run_dir, verdict.failure)
        if change is None:
            code = keeper.finish(verdict)
            after_end(run_dir)
            return code
        retries += 1
        attempt = int(read_state(run_dir).get("attempt") or 1) + 1
        update_state(run_dir, status="starting", reason=change, attempt=attempt,
                     pids={"workers": [], "agent": None, "monitor": None})  # fmt: skip
        append_event(run_dir, RetryEvent(reason=change, after=verdict.reason, attempt=attempt))
        append_event(run_dir, StateEvent(status="starting", reason=change))


if __name__ == "__main__":
    sys.exit(main())
