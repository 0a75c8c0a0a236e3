"""The keeper: the small supervisor that owns one run and outlives the terminal.

``python -m homelab_dp.run.keeper RUN_DIR`` is started by the controller in a new session with
its output in ``logs/keeper.log`` (never a pipe to a terminal). It starts torchrun and the
device monitor, records every pid in ``state.json``, forwards a graceful stop to the workers,
waits for torchrun, and writes the final status with the reason. When the torchrun agent dies
(even by SIGKILL) its workers are not left running as orphans: the keeper ends them.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from homelab_dp.run import launcher
from homelab_dp.run.follow import read_all
from homelab_dp.run.rundir import append_event, read_spec
from homelab_dp.run.state import diagnose_failure, pid_alive, read_state, update_state

WORKER_GRACE_S = 20.0
"""How long orphaned workers get to exit after SIGTERM before SIGKILL."""


class Keeper:
    """Supervises one launch (a fresh start or a resume) of a run."""

    def __init__(self, run_dir: Path, multinode: dict[str, Any] | None = None) -> None:
        self.run_dir = run_dir
        self.spec = read_spec(run_dir)
        self.multinode = multinode or {}
        self.agent: subprocess.Popen | None = None
        self.monitor: subprocess.Popen | None = None
        self.stop_requested = False

    # -------------------------------------------------------------- processes
    def _start_monitor(self) -> subprocess.Popen:
        log = open(self.run_dir / "logs" / "monitor.log", "ab")  # noqa: SIM115 - child owns it
        return subprocess.Popen(
            [sys.executable, "-m", "homelab_dp.run.monitor", str(self.run_dir)],
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
        return [c.pid for c in children if "homelab_dp.train.worker" in " ".join(_cmdline(c))]

    def request_stop(self, signum: int = signal.SIGTERM, frame: Any = None) -> None:
        """Graceful stop: every worker gets SIGTERM; the ranks agree, checkpoint and exit."""
        # The supervision loop sends each worker one SIGTERM: a second one could land while a
        # rank is already shutting down with the default handler back in place.
        self.stop_requested = True
        update_state(self.run_dir, status="stopping", reason="stop requested")

    # -------------------------------------------------------------- lifecycle
    def run(self) -> int:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, self.request_stop)
        resolved = self.spec["resolved"]
        nproc = int(self.spec.get("nproc_per_node") or resolved["world_size"])
        if self.spec.get("gpu_indices"):
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, self.spec["gpu_indices"]))
        update_state(self.run_dir, status="starting", pids={"keeper": os.getpid()})
        self.agent = launcher.launch(self.run_dir, nproc, **self.multinode)
        self.monitor = self._start_monitor()
        update_state(
            self.run_dir,
            status="running",
            pids={"agent": self.agent.pid, "monitor": self.monitor.pid},
        )
        recorded: list[int] = []
        signalled: set[int] = set()
        while self.agent.poll() is None:
            new = [p for p in self.worker_pids() if p not in recorded]
            if new:  # record every worker ever seen; exited ones stay for the post-mortem
                recorded += new
                update_state(self.run_dir, pids={"workers": recorded})
            if self.stop_requested:  # also reaches workers that appeared after the request
                for pid in set(recorded) - signalled:
                    _signal(pid, signal.SIGTERM)
                signalled.update(recorded)
            time.sleep(0.2)
        rc = self.agent.returncode
        self._end_orphans(recorded)
        self._stop_monitor()
        status, reason = self.final_status(rc)
        update_state(self.run_dir, status=status, reason=reason, exit_code=rc, ended=time.time())
        append_event(self.run_dir, {"type": "state", "status": status, "reason": reason})
        return 0 if status in ("completed", "interrupted") else 1

    def _end_orphans(self, workers: list[int]) -> None:
        """Workers still alive after the agent is gone (agent killed): stop them, then kill."""
        alive = [p for p in workers if pid_alive(p)]
        for pid in alive:
            _signal(pid, signal.SIGTERM)
        deadline = time.time() + WORKER_GRACE_S
        while alive and time.time() < deadline:
            time.sleep(0.2)
            alive = [p for p in alive if pid_alive(p)]
        for pid in alive:
            _signal(pid, signal.SIGKILL)

    def _stop_monitor(self) -> None:
        if self.monitor is not None and self.monitor.poll() is None:
            self.monitor.terminate()
            try:
                self.monitor.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.monitor.kill()
                self.monitor.wait()

    def final_status(self, rc: int | None) -> tuple[str, str]:
        """(status, reason) from the worker's end event, torchrun's exit code and error files."""
        ends = [e for e in read_all(self.run_dir / "events.jsonl") if e.get("type") == "end"]
        errors = [e for e in read_all(self.run_dir / "events.jsonl") if e.get("type") == "error"]
        if rc == 0 and ends and ends[-1].get("reason") == "completed":
            return "completed", f"{ends[-1].get('steps', '?')} steps, result in final/"
        if rc == 0 and ends and ends[-1].get("reason") == "stopped":
            return "interrupted", "stopped by request; resume with `homelab-dp resume`"
        if rc == 0 and not ends and int(self.multinode.get("nnodes") or 1) > 1:
            # c10d hands out global ranks in joining order: rank 0 (events, checkpoints'
            # metadata, the result) may live on another node's run folder.
            return "completed", "this node's workers finished; rank 0 ran on another node"
        if errors:
            e = errors[-1]
            return "failed", f"rank {e.get('rank', '?')}: {e.get('message', 'error')}"
        diagnosis = diagnose_failure(self.run_dir)
        if rc is not None and rc < 0:
            return "failed", f"torchrun agent killed by signal {signal.Signals(-rc).name}"
        return "failed", diagnosis or f"torchrun exited with code {rc}"


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return []


def _signal(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone: nothing to stop
        os.kill(pid, sig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="homelab-dp run keeper (started by the controller)"
    )
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--nnodes", type=int, default=1)
    parser.add_argument("--node-rank", type=int, default=0)
    parser.add_argument("--master-addr", default="127.0.0.1")
    parser.add_argument("--master-port", type=int, default=None)
    args = parser.parse_args(argv)
    multinode = {
        "nnodes": args.nnodes,
        "node_rank": args.node_rank,
        "master_addr": args.master_addr,
        "master_port": args.master_port,
    }
    if args.nnodes > 1:  # every node names the rendezvous the same; run folders differ per node
        multinode["rdzv_id"] = f"homelab-dp-{args.master_addr}-{args.master_port}"
    return Keeper(args.run_dir, multinode).run()


if __name__ == "__main__":
    sys.exit(main())
