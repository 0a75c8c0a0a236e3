"""The run controller: start, list, inspect, follow, stop and resume runs.

One object behind both front ends (the CLI and the TUI build it through `make_controller`,
and so do the tests). A run is a folder under the runs root; the controller never keeps state
of its own, so a run started over one SSH connection is seen and followed from any other.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from homelab_dp.core.events import StateEvent
from homelab_dp.core.planner import Plan
from homelab_dp.core.preset import Preset
from homelab_dp.core.preset_store import open_preset
from homelab_dp.core.run_view import RunView
from homelab_dp.core.runspec import Launch, ModelOrigin, Rendezvous, Resolved, RunSpec
from homelab_dp.errors import HomelabError, RunStateError
from homelab_dp.run import preflight
from homelab_dp.run import queue as waiting_room
from homelab_dp.run.model_source import model_doc, with_local_model
from homelab_dp.run.planning import Planned, cpu_hardware, make_plan, with_target_share
from homelab_dp.run.relaunch import resume_step
from homelab_dp.rundir.files import (
    append_event,
    create_run_dir,
    new_run_id,
    read_run_spec,
    runs_root,
    write_run_spec,
)
from homelab_dp.rundir.index import IndexedRun, find_run, forget_gone, known_runs
from homelab_dp.rundir.state import (
    ACTIVE,
    alive_pids,
    current_state,
    signal_run_process,
    update_state,
)
from homelab_dp.rundir.tail import RunTail, read_all

STOP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class Prepared:
    """A run that passed every check and is ready to start."""

    preset: Preset
    planned: Planned
    resolved: Resolved
    blocks: int
    origin: ModelOrigin | None = None
    """The Hugging Face id ``preset.model.path`` was given as (the path is now its snapshot)."""

    @property
    def plan(self) -> Plan:
        return self.planned.plan

    def run_spec(
        self,
        run_id: str,
        rendezvous: Rendezvous | None = None,
        *,
        auto_fit: bool = False,
        measure_steps: int = 0,
    ) -> RunSpec:
        """The run contract for this prepared run: the one builder of `RunSpec`."""
        rdzv = rendezvous or Rendezvous()
        launch = Launch(
            nproc_per_node=self.resolved.world_size // rdzv.nnodes,
            gpu_indices=tuple(self.planned.hardware.indices),
            rendezvous=rdzv,
            gpu_uuids=tuple(self.planned.hardware.uuids),
        )
        return RunSpec(
            run_id=run_id,
            preset=self.preset,
            resolved=self.resolved,
            launch=launch,
            plan=self.plan.to_json(),
            blocks=self.blocks,
            auto_fit=auto_fit,
            collective_timeout_s=self.preset.train.collective_timeout_s or None,
            measure_steps=measure_steps,
            model_origin=self.origin,
        )


class RunController:
    """Everything the front ends do with runs."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or runs_root()).absolute()

    # ------------------------------------------------------------------ lookup
    def run_dir(self, run_id: str) -> Path:
        """The folder of a run by id, unique id prefix or folder path, wherever it lives: the
        per-user run index, this root or ./runs (`rundir.index.find_run`). Raises a
        RunNotFoundError that says whether the id is unknown, ambiguous or its folder gone."""
        return find_run(run_id, self.root)

    def _run_dirs(self) -> list[Path]:
        """Every known run folder that is still there, oldest first."""
        return [run.path for run in known_runs(self.root) if run.exists]

    # ------------------------------------------------------------------ preparing
    def prepare(
        self,
        preset_ref: str,
        *,
        overrides: list[str] | None = None,
        gpus: str | None = None,
        force: bool = False,
        nnodes: int = 1,
        queue: bool = False,
    ) -> Prepared:
        """Preflight in this process: preset, loggers, plan, torch for a CUDA plan, model
        folder (a model id's snapshot, downloaded when missing), data. Raises HomelabError.
        ``queue``: the run will wait for its cards, so it is planned on them idle; otherwise
        devices another run is using refuse it (unless ``force``)."""
        preset = open_preset(preset_ref, overrides)
        preflight.check_reporters(preset)  # a logger not installed: before the plan
        if gpus and not gpus.lower().startswith("cpu"):
            raise HomelabError(
                f"--gpus {gpus}: `run` uses real devices; sizes are for `plan` what-ifs",
                hint="choose GPUs with hardware.devices (e.g. --set hardware.devices=[0,1]) "
                "or run on the CPU with --gpus cpu:2",
            )
        planned = make_plan(preset, gpus)
        if gpus:  # cpu:N — check the count against this machine's cores
            cpu_hardware(planned.hardware.world_size, planned.hardware.min_memory, "run")
        hw = planned.hardware
        if queue:
            planned = waiting_room.on_idle_cards(planned, gpus)
        elif not force:  # before the fit: another run's memory would read as "does not fit"
            waiting_room.check_devices_free(
                waiting_room.devices_on(hw.kind, hw.indices, hw.uuids), self.root
            )
        p = planned.plan
        if not p.fits and not force:
            chosen = [r for r in p.reasons if r.startswith("Chosen:")]
            raise HomelabError(
                "the plan does not fit: " + (chosen[0] if chosen else p.reasons[-1]),
                hint=("; ".join(p.advice) or "see `homelab-dp plan`")
                + " — or pass --force to try anyway",
            )
        preflight.check_torch_sees_cards(planned.hardware, planned.report)
        # A model id was planned from its config.json; the run needs the whole snapshot, and
        # its workers (and any resume) get the local folder, never the id.
        preset, origin = with_local_model(preset)
        planned = replace(planned, preset=preset)
        preflight.check_model_folder(preset)
        ws = p.world_size * nnodes  # multi-node: every node runs the same devices
        blocks, share = preflight.check_data(preset, planned.spec.max_positions, ws,
                                             p.micro_batch)  # fmt: skip
        # The plan chose with every token taken as a target; the run records its estimate for
        # this data (the chunked loss keeps only target rows), which `measure` compares.
        planned = replace(planned, plan=with_target_share(planned, share))
        p = planned.plan
        resolved = Resolved(
            method=p.chosen.method,  # type: ignore[arg-type]
            distribution=p.chosen.distribution,  # type: ignore[arg-type]
            activation_checkpointing=p.chosen.activation_checkpointing,
            device=planned.hardware.kind,
            world_size=ws,
            dtype=p.dtype,  # type: ignore[arg-type]
            micro_batch=p.micro_batch,
            grad_accum=p.grad_accum,
            lr=p.lr.applied,
            offload=p.chosen.offload,  # type: ignore[arg-type]
            offload_activations=p.chosen.offload_activations,
        )
        return Prepared(preset, planned, resolved, blocks, origin)

    # ------------------------------------------------------------------ starting
    def start(
        self,
        prepared: Prepared,
        rendezvous: Rendezvous | None = None,
        *,
        auto_fit: bool = False,
        queue: bool = False,
        force: bool = False,
    ) -> str:
        """Create the run folder and start its keeper in the background; return the run id.

        ``auto_fit``: when a rank runs out of memory, the keeper resumes the run with the
        worker's proposal (smaller micro-batch, more accumulation, same effective batch; or
        activation checkpointing) by itself, up to `MAX_OOM_RETRIES` times.
        ``queue``: the run is created "queued" and its keeper starts it when its devices are
        free (`homelab_dp.run.queue`). Otherwise a start on devices another run is using is
        refused, unless ``force``.
        """
        rendezvous = rendezvous or Rendezvous()
        check_port(rendezvous)
        name = Path(prepared.preset.source).stem if prepared.preset.source else "run"
        run_id = new_run_id(name)
        spec = prepared.run_spec(run_id, rendezvous, auto_fit=auto_fit)
        if not queue and not force:
            waiting_room.check_devices_free(waiting_room.devices_of(spec), self.root)
        status = "queued" if queue else "starting"

        def fill(folder: Path) -> None:  # written before the folder takes its name: all or none
            update_state(folder, status=status, run_id=run_id, created=time.time(), attempt=1)
            append_event(folder, StateEvent(status=status, run_id=run_id))

        run_dir = create_run_dir(spec, self.root, fill)
        self._spawn_keeper(run_dir)
        return run_id

    def _spawn_keeper(self, run_dir: Path) -> int:
        (run_dir / "logs").mkdir(mode=0o700, exist_ok=True)  # a folder that lost it (damage)
        log = open(run_dir / "logs" / "keeper.log", "ab")  # noqa: SIM115 - the child owns it
        proc = subprocess.Popen(
            [sys.executable, "-m", "homelab_dp.run.keeper", str(run_dir)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # closing the terminal or killing the CLI changes nothing
            cwd=run_dir,
        )
        log.close()
        update_state(run_dir, pids={"keeper": proc.pid})
        return proc.pid

    def resume(
        self,
        run_id: str,
        rendezvous: Rendezvous | None = None,
        *,
        queue: bool = False,
        force: bool = False,
    ) -> str:
        """Continue a stopped or failed run from its newest complete checkpoint.

        ``queue`` (and always for a run interrupted while queued: it never started) puts it in
        the queue; otherwise devices another run is using refuse it, unless ``force``."""
        run_dir = self.run_dir(run_id)
        spec = read_run_spec(run_dir)  # a damaged run says so before anything else
        state = current_state(run_dir)
        status = state.get("status")
        if status == "completed":
            raise RunStateError(
                f"run {run_dir.name}: already completed; nothing to resume",
                hint=f"the result is in {run_dir / 'final'}",
            )
        if status in ACTIVE or status == "queued":
            raise RunStateError(
                f"run {run_dir.name}: still {status}",
                hint=f"follow it with `homelab-dp attach {run_dir.name}`",
            )
        # A run interrupted while queued never started: it queues again (from step 0).
        queued = queue or bool(state.get("queued_only"))
        if not queued and not force:
            waiting_room.check_devices_free(waiting_room.devices_of(spec), self.root)
        write_run_spec(run_dir, spec.relaunched(rendezvous or Rendezvous()))
        status = "queued" if queued else "starting"
        step = None if state.get("queued_only") else resume_step(run_dir)
        how = ("" if step is None else f"from checkpoint step {step}" if step
               else "from step 1: it has no usable checkpoint")  # fmt: skip
        update_state(
            run_dir,
            status=status,
            reason=("queued again" if queued else "resuming") + (f" {how}" if how else ""),
            resume_from=step,
            attempt=int(state.get("attempt", 1)) + (0 if queued else 1),
            queued_only=None,
            ended=None,
            pids={"keeper": None, "workers": [], "agent": None, "monitor": None},
        )
        append_event(run_dir, StateEvent(status=status, resume=True, reason=how or None))
        self._spawn_keeper(run_dir)
        return run_dir.name

    # ------------------------------------------------------------------ stopping
    def stop(self, run_id: str, timeout: float = STOP_TIMEOUT_S) -> dict[str, Any]:
        """Graceful stop: the keeper tells every rank; they agree, checkpoint and exit."""
        run_dir = self.run_dir(run_id)
        state = current_state(run_dir)
        if state.get("status") == "queued":
            left = waiting_room.leave_queue(run_dir, state, timeout)
            if left is not None:
                return left
            state = current_state(run_dir)  # its turn came just before the request: stop it
        if state.get("status") not in ACTIVE:
            raise RunStateError(
                f"run {run_dir.name}: not running ({state.get('status')})",
                hint="`homelab-dp status RUN` shows its state",
            )
        keeper = (state.get("pids") or {}).get("keeper")
        workers = (state.get("pids") or {}).get("workers") or []
        targets = [keeper] if keeper and keeper in alive_pids(state, run_dir) else workers
        for pid in targets:  # only a pid that is still the run's process (never a stranger's)
            signal_run_process(state, int(pid), signal.SIGTERM, run_dir)
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = current_state(run_dir)
            if state.get("status") not in ACTIVE and not alive_pids(state, run_dir):
                return state
            time.sleep(0.3)
        raise RunStateError(
            f"run {run_dir.name}: still running {timeout:.0f} s after the stop request",
            hint="a rank may be stuck in a collective; check its logs, then kill its pids",
        )

    # ------------------------------------------------------------------ inspecting
    def view(self, run_id: str) -> RunView:
        """Every event and sample of the run folded into a RunView, with the current status."""
        return self._fold(self.run_dir(run_id))

    def _fold(self, run_dir: Path) -> RunView:
        view = self.new_view(run_dir)
        for event in read_all(run_dir / "events.jsonl"):
            view.apply(event)
        for sample in read_all(run_dir / "devices.jsonl"):
            view.apply(sample)
        view.apply_state(current_state(run_dir))
        return view

    def new_view(self, run_dir: Path) -> RunView:
        """An empty view of the run, with what its run spec says: cost per kWh, estimate, and
        the strategy (a queued run has no start event yet; the worker's repeats it)."""
        spec = read_run_spec(run_dir)
        return RunView(
            run_id=run_dir.name,
            method=spec.resolved.method,
            distribution=spec.resolved.distribution,
            world_size=spec.resolved.world_size,
            per_kwh=float(spec.preset.cost.per_kwh or 0.0),
            currency=str(spec.preset.cost.currency or ""),
            estimate_bytes=spec.planned_bytes.get("total"),
        )

    def tail(self, run_id: str) -> RunTail:
        return RunTail(self.run_dir(run_id))

    def status(self, run_id: str) -> dict[str, Any]:
        """The `status --json` document: state, progress and final figures."""
        run_dir = self.run_dir(run_id)
        return summarize(run_dir, self._fold(run_dir), current_state(run_dir))

    def list_runs(self) -> list[dict[str, Any]]:
        """Every known run (index, root, ./runs), newest first (`runs --json`). Each row has
        ``path`` and ``exists``; a folder that has gone, or cannot be read, is a row that says so
        (``status`` null, ``reason``), never an error."""
        rows = [self._row(run) for run in known_runs(self.root)]
        return sorted(rows, key=lambda r: r.get("created") or 0, reverse=True)

    def forget_gone(self) -> list[str]:
        """Drop the runs whose folder has gone from the per-user index; their ids."""
        return [run.id for run in forget_gone()]

    def _row(self, run: IndexedRun) -> dict[str, Any]:
        """One run of `list_runs`: its summary; for a folder that has gone, status null; for a
        folder that is there but cannot be read (damaged), status "damaged" and the reason."""
        reason, status = "folder gone", None
        if run.exists:
            try:
                state = current_state(run.path)
                return {**summarize(run.path, self._fold(run.path), state), "exists": True}
            except (OSError, ValueError, KeyError, TypeError, HomelabError) as exc:
                reason, status = str(exc), "damaged"
        return {"run_id": run.id, "path": str(run.path), "exists": run.exists, "status": status,
                "reason": reason, "created": run.created}  # fmt: skip


def summarize(run_dir: Path, view: RunView, state: dict[str, Any]) -> dict[str, Any]:
    """One run as a JSON-ready dict (a queued run's ``queue``: position and what it waits for)."""
    started = state.get("created")
    ended = state.get("ended")
    duration = (ended or time.time()) - started if started and state.get("status") else None
    return {
        "run_id": run_dir.name,
        "path": str(run_dir),
        "status": state.get("status"),
        "reason": state.get("reason"),
        "created": started,
        "duration_s": duration,
        "model": model_doc(read_run_spec(run_dir)),
        "method": view.method,
        "distribution": view.distribution,
        "world_size": view.world_size,
        "step": view.step,
        "total_steps": view.total_steps,
        "loss": view.loss,
        "tokens": view.tokens,
        "tokens_per_s": view.tokens_per_s,
        "mfu": view.mfu,
        "effective_batch": view.effective_batch,
        "energy_wh": view.energy_wh,
        "tokens_per_wh": view.tokens_per_wh,
        "cost": view.cost,
        "last_checkpoint_step": view.last_checkpoint_step,
        "eval": view.eval_doc(),
        "final_path": view.final_path,
        "peak_memory_bytes": view.peak_memory_bytes,
        "estimate_bytes": view.estimate_bytes,
        "stragglers": [view.stragglers[k] for k in sorted(view.stragglers)],
        "pids": state.get("pids"),
        "exit_code": state.get("exit_code"),
        "attempt": state.get("attempt"),
        "queue": waiting_room.queue_doc(run_dir, state),
    }


def check_port(rendezvous: Rendezvous) -> None:
    """A single-node run given ``--master-port`` needs it free: say so before anything starts."""
    if rendezvous.nnodes != 1 or not rendezvous.master_port:
        return
    port = rendezvous.master_port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise HomelabError(
                f"--master-port {port}: 127.0.0.1:{port} is already in use ({exc.strerror})",
                hint="leave out --master-port (a single-node run takes a free port by itself) "
                "or choose another port",
            ) from None


def make_controller(root: Path | None = None) -> RunController:
    """The one factory both front ends (and the tests) use."""
    return RunController(root)
