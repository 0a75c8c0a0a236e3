"""The replica processes: start them, watch them, restart the ones that die, stop them all.

Each replica is `python -m homelab_dp.serving.replica.transformers_replica` (``engine="vllm"``:
`homelab_dp.serving.replica.vllm_replica`, the same protocol) in its own session (so a Ctrl-C in the
terminal reaches the front only, which then stops them in order), with its output in
``replica-K.log`` in a private state folder (0700, removed at the end) and the shared secret
in its environment. A replica is *ready* once it wrote ``replica-K.json`` (its port) and its
``GET /ready`` answers. One that exits is *restarting* until its new process is ready again;
after `MAX_QUICK` quick failures in a row (each before it was ready or within `QUICK_S` of its
start), or at once when it exits 2 before being ready (it cannot load the model), it is
*failed* and stays down.

Heartbeat: every `HEARTBEAT_S` each ready replica's ``GET /ready`` is asked (in the
background, `PROBE_TIMEOUT_S` each); one that has not answered for `UNRESPONSIVE_S` (stopped,
hung, swapping) is *unresponsive*: /health says so and no request goes to it until it
answers again. A replica's environment holds the per-serve secret, the front's pid (the
replica exits when its front is gone: `homelab_dp.serving.replica.replica_protocol`), and never the user's
API key.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import aiohttp

from homelab_dp.probe.visible_gpus import cuda_device_env

State = Literal["starting", "ready", "unresponsive", "restarting", "failed"]
REPLICA_MODULES = {
    "transformers": "homelab_dp.serving.replica.transformers_replica",
    "vllm": "homelab_dp.serving.replica.vllm_replica",
}
"""The replica module of each engine (both speak the replica protocol)."""
TOKEN_ENV = "HOMELAB_DP_REPLICA_TOKEN"
FRONT_PID_ENV = "HOMELAB_DP_FRONT_PID"
"""The front's pid, for a replica to notice it was orphaned before it could look."""
SECRET_ENVS = ("HOMELAB_DP_API_KEY",)
"""The user's secrets, which a replica never needs (it has its own per-serve token)."""
HEARTBEAT_S = 1.0
"""How often a ready replica's /ready is asked."""
PROBE_TIMEOUT_S = 2.0
"""How long one /ready may take."""
UNRESPONSIVE_S = 5.0
"""A ready replica with no /ready answer for this long is unresponsive."""
QUICK_S = 30.0
"""An exit this soon after the start (or before it was ready) counts as a quick failure."""
MAX_QUICK = 3
"""Quick failures in a row after which a replica is left failed."""
BACKOFF_S = (0.0, 1.0, 3.0)
"""Wait before a restart, by how many quick failures in a row preceded it."""
GRACE_S = 5.0
"""SIGTERM, then this long, then SIGKILL."""
BAD_INPUT = 2
"""A replica's exit code when it cannot load the model (an `error:` line in its log)."""


@dataclass(frozen=True)
class ReplicaLaunch:
    """Where one replica runs (what the serving plan chose)."""

    device: str
    """"cpu" or "cuda:0" as the replica sees it."""
    label: str
    """What /health shows as its device ("cpu", "GPU 1 (NVIDIA GeForce RTX 3090)")."""
    cuda_visible: str | None = None
    """CUDA_VISIBLE_DEVICES for it (a card's UUID or index); None on CPU."""
    threads: int | None = None
    """CPU threads for a CPU replica."""


@dataclass
class Replica:
    """One replica slot and the process currently behind it."""

    id: int
    """Its slot number (K in replica-K.json), stable across restarts."""
    launch: ReplicaLaunch
    """Where it runs."""
    state: State = "starting"
    """starting | ready | unresponsive | restarting | failed."""
    proc: subprocess.Popen[bytes] | None = None
    """The live process (None between an exit and its restart)."""
    port: int | None = None
    """Its loopback port, once replica-K.json said it."""
    context: int | None = None
    """The model's context in tokens, from replica-K.json."""
    started_at: float = 0.0
    """time.monotonic() of its last start."""
    quick_failures: int = 0
    """Quick failures in a row."""
    restart_at: float = 0.0
    """When to start it again (while restarting with no process)."""
    suspect: bool = False
    """A request to it failed: not picked until /ready answers again."""
    last_seen: float = 0.0
    """time.monotonic() of its last /ready answer."""
    probing: bool = False
    """A heartbeat probe is under way."""

    @property
    def pid(self) -> int | None:
        """The pid of the live process, if any."""
        return self.proc.pid if self.proc is not None else None


class Supervisor:
    """Starts, watches, restarts and stops the replica processes of one model."""

    def __init__(
        self,
        model: str,
        launches: Sequence[ReplicaLaunch],
        *,
        max_batch: int | None = None,
        engine: str = "transformers",
        context: int | None = None,
        gpu_memory_utilization: float | None = None,
        python: str = sys.executable,
    ) -> None:
        if engine not in REPLICA_MODULES:
            raise ValueError(f"engine {engine!r}: one of {', '.join(REPLICA_MODULES)}")
        self.model = model
        self.max_batch = max_batch
        self.engine = engine
        # vLLM replicas only: their max_model_len cap and share of the card (None: defaults).
        self.context_cap = context  # (`context()` is the context the replicas report)
        self.gpu_memory_utilization = gpu_memory_utilization
        self.python = python
        self.token = secrets.token_urlsafe(32)
        self.state_dir = Path(tempfile.mkdtemp(prefix="homelab-dp-serve-"))  # 0700
        self.replicas = [Replica(i, launch) for i, launch in enumerate(launches)]
        self._changed = asyncio.Event()
        self._beats: set[asyncio.Task[None]] = set()

    # -- what the front asks --------------------------------------------------------------

    def ready_ids(self) -> list[int]:
        """The replicas that may take a request now."""
        return [r.id for r in self.replicas if r.state == "ready" and not r.suspect]

    def all_failed(self) -> bool:
        """Every replica is down for good."""
        return all(r.state == "failed" for r in self.replicas)

    def settled(self) -> bool:
        """Every replica is ready or failed (the start is over)."""
        return all(r.state in ("ready", "failed") for r in self.replicas)

    def changed(self) -> asyncio.Event:
        """An event set at the next change of state (take it before checking the state)."""
        return self._changed

    def context(self) -> int | None:
        """The model's context length, once a replica told it."""
        return next((r.context for r in self.replicas if r.context), None)

    def url(self, replica: int, path: str) -> str:
        """A replica's endpoint."""
        return f"http://127.0.0.1:{self.replicas[replica].port}{path}"

    def headers(self) -> dict[str, str]:
        """The replicas' authorization."""
        return {"Authorization": f"Bearer {self.token}"}

    def suspect(self, replica: int) -> None:
        """A request to ``replica`` failed: skip it until it answers /ready again."""
        r = self.replicas[replica]
        r.suspect = True
        self._reap(r, time.monotonic())

    def report(self) -> list[dict[str, Any]]:
        """Per replica: id, device (label), pid, state."""
        return [
            {"id": r.id, "device": r.launch.label, "pid": r.pid, "state": r.state}
            for r in self.replicas
        ]

    # -- the processes --------------------------------------------------------------------

    def command(self, r: Replica) -> list[str]:
        """The replica's command line (the replica protocol)."""
        cmd = [self.python, "-m", REPLICA_MODULES[self.engine], "--model", self.model, "--device"]
        cmd += [r.launch.device, "--id", str(r.id), "--state-dir", str(self.state_dir)]
        if self.engine == "vllm":  # vLLM schedules its own batches: no --max-batch
            if self.context_cap is not None:
                cmd += ["--context", str(self.context_cap)]
            if self.gpu_memory_utilization is not None:
                cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
            return cmd
        if self.max_batch is not None:
            cmd += ["--max-batch", str(self.max_batch)]
        if r.launch.threads is not None:
            cmd += ["--threads", str(r.launch.threads)]
        return cmd

    def environment(self, r: Replica) -> dict[str, str]:
        """The replica's environment: ours less the user's secrets, the token, the front's pid,
        its card (`cuda_device_env`: PCI bus order with it), its threads."""
        env = {k: v for k, v in os.environ.items() if k not in SECRET_ENVS}
        env["PYTHONUNBUFFERED"] = "1"
        env[TOKEN_ENV] = self.token
        env[FRONT_PID_ENV] = str(os.getpid())
        if r.launch.cuda_visible is not None:
            env = cuda_device_env(env, [r.launch.cuda_visible])
        elif r.launch.device == "cpu":
            env = cuda_device_env(env, [])  # a CPU replica never holds a CUDA context
        if r.launch.threads is not None:
            env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(r.launch.threads)
        return env

    def start(self) -> None:
        """Start every replica."""
        for r in self.replicas:
            self._spawn(r)

    def _spawn(self, r: Replica) -> None:
        (self.state_dir / f"replica-{r.id}.json").unlink(missing_ok=True)  # never a stale port
        r.port = None
        with open(self.state_dir / f"replica-{r.id}.log", "ab") as log:
            r.proc = subprocess.Popen(
                self.command(r),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env=self.environment(r),
                start_new_session=True,
            )
        r.started_at = time.monotonic()

    def _reap(self, r: Replica, now: float) -> None:
        """If its process exited: restarting (after a backoff) or failed."""
        if r.proc is None or (code := r.proc.poll()) is None:
            return
        r.proc = None
        # Quick: it never got ready (a slow load counts too), or it died soon after its start.
        quick = r.state not in ("ready", "unresponsive") or now - r.started_at < QUICK_S
        r.quick_failures = r.quick_failures + 1 if quick else 0
        if code == BAD_INPUT and r.state not in ("ready", "unresponsive"):
            r.state = "failed"  # it could not load the model: another try fails the same way
            self._say(f"replica {r.id} ({r.launch.label}) cannot start", r.id)
        elif r.quick_failures >= MAX_QUICK:
            r.state = "failed"
            self._say(f"replica {r.id} ({r.launch.label}) failed {MAX_QUICK} times in a row", r.id)
        else:
            r.state = "restarting"
            r.restart_at = now + BACKOFF_S[min(r.quick_failures, len(BACKOFF_S) - 1)]
            self._say(f"replica {r.id} ({r.launch.label}) exited ({code}); restarting")
        self._notify()

    def log_tail(self, replica: int, lines: int = 5) -> str:
        """The last lines of a replica's log."""
        path = self.state_dir / f"replica-{replica}.log"
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def _say(self, message: str, log_of: int | None = None) -> None:
        """A line on stderr (stdout is for the ready line only), with a log's tail."""
        sys.stderr.write(message + "\n")
        tail = self.log_tail(log_of) if log_of is not None else ""
        if tail:
            sys.stderr.write("  " + tail.replace("\n", "\n  ") + "\n")
        sys.stderr.flush()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- watching -------------------------------------------------------------------------

    async def _probe(self, r: Replica, session: aiohttp.ClientSession) -> None:
        """Read its port once written, then ask /ready."""
        if r.port is None:
            try:
                info = json.loads((self.state_dir / f"replica-{r.id}.json").read_text())
            except (OSError, ValueError):
                return
            if r.proc is None or info.get("pid") != r.proc.pid:
                return
            r.port, r.context = int(info["port"]), info.get("context")
        proc = r.proc
        try:
            timeout = aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            async with session.get(
                self.url(r.id, "/ready"), headers=self.headers(), timeout=timeout
            ) as resp:
                ok = resp.status == 200
        except (aiohttp.ClientError, OSError, asyncio.TimeoutError):
            ok = False
        if not ok or r.proc is None or r.proc is not proc:
            return  # (a process that was replaced meanwhile: its answer says nothing)
        r.last_seen = time.monotonic()
        if r.state != "ready" or r.suspect:
            if r.state == "unresponsive":
                self._say(f"replica {r.id} ({r.launch.label}) answers again")
            r.state, r.suspect = "ready", False
            self._notify()

    async def _beat(self, r: Replica, session: aiohttp.ClientSession) -> None:
        try:
            await self._probe(r, session)
        finally:
            r.probing = False

    def _heartbeat(self, r: Replica, session: aiohttp.ClientSession, now: float) -> None:
        """A ready replica: probe it in the background now and then, and mark it unresponsive
        once it has been silent for `UNRESPONSIVE_S`."""
        if r.state == "ready" and now - r.last_seen > UNRESPONSIVE_S:
            r.state = "unresponsive"
            self._say(
                f"replica {r.id} ({r.launch.label}) has not answered for {UNRESPONSIVE_S:g} s; "
                "no requests go to it until it does"
            )
            self._notify()
        if not r.probing and (r.suspect or now - r.last_seen >= HEARTBEAT_S):
            r.probing = True
            task = asyncio.create_task(self._beat(r, session))
            self._beats.add(task)
            task.add_done_callback(self._beats.discard)

    async def check(self, session: aiohttp.ClientSession) -> None:
        """One look at every replica: reap exits, restart when due, probe the unconfirmed."""
        now = time.monotonic()
        probes = []
        for r in self.replicas:
            self._reap(r, now)
            if r.state == "restarting" and r.proc is None and now >= r.restart_at:
                self._spawn(r)
            if r.proc is None:
                continue
            if r.state in ("ready", "unresponsive"):
                self._heartbeat(r, session, now)
            elif not r.probing:
                probes.append(self._probe(r, session))
        await asyncio.gather(*probes)

    async def watch(self, session: aiohttp.ClientSession, interval: float = 0.2) -> None:
        """Check every ``interval`` seconds, until cancelled."""
        while True:
            await self.check(session)
            await asyncio.sleep(interval)

    def stop(self, grace: float = GRACE_S) -> None:
        """SIGTERM every replica's process group, wait ``grace``, SIGKILL what is left."""
        live = [r.proc for r in self.replicas if r.proc is not None]
        for proc in live:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while any(p.poll() is None for p in live) and time.monotonic() < deadline:
            time.sleep(0.05)
        for proc in live:
            if proc.poll() is None:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
        for r in self.replicas:
            r.proc = None

    def cleanup(self) -> None:
        """Remove the state folder (logs, port files)."""
        shutil.rmtree(self.state_dir, ignore_errors=True)


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    """Signal the replica's whole session (it leads its own process group)."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
