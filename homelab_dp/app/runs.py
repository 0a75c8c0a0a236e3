"""The run controller: start, list, inspect, follow, stop and resume runs.

One object behind both front ends (the CLI and the TUI build it through `make_controller`,
and so do the tests). A run is a folder under the runs root; the controller never keeps state
of its own, so a run started over one SSH connection is seen and followed from any other.

Checks made in the parent process before anything is spawned: loggers, model folder, data,
plan, and for a CUDA plan that the installed torch sees the planned cards.

Every problem found here is a `HomelabError` (exit 2, nothing started, nothing written).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from homelab_dp.app import doctor
from homelab_dp.app.plan import (
    Planned,
    auto_fit_preset,
    cpu_hardware,
    make_plan,
    on_idle_cards,
    with_target_share,
)
from homelab_dp.errors import (
    HardwareSpecError,
    HomelabError,
    ModelSpecError,
    PresetError,
    RunStateError,
)
from homelab_dp.hub.hub_models import ModelOrigin
from homelab_dp.planning.plan_hardware import PlanHardware
from homelab_dp.planning.plan_result import Fit
from homelab_dp.planning.planner import Plan
from homelab_dp.presets.preset import Preset
from homelab_dp.presets.preset_store import open_preset
from homelab_dp.probe.hardware import HardwareReport
from homelab_dp.runs import run_queue as waiting_room
from homelab_dp.runs.folder.jsonl_tail import RunTail, file_size
from homelab_dp.runs.folder.run_folder import (
    RUNS_ENV,
    append_event,
    create_run_dir,
    new_run_id,
    open_runs_root,
    read_run_spec,
    runs_root,
    write_run_spec,
)
from homelab_dp.runs.folder.run_index import IndexedRun, find_run, forget_gone, known_runs
from homelab_dp.runs.folder.run_state import (
    ACTIVE,
    alive_pids,
    current_state,
    signal_run_process,
    update_state,
)
from homelab_dp.runs.model_ref import with_local_model
from homelab_dp.runs.run_events import StateEvent
from homelab_dp.runs.run_spec import Launch, Rendezvous, Resolved, RunSpec
from homelab_dp.runs.run_view import RunView, new_view, summarize, view_of
from homelab_dp.supervise.keeper import settle_dead_run
from homelab_dp.supervise.relaunch import resume_step
from homelab_dp.vocabulary import PREFERENCE_OBJECTIVES

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
REPORTER_INSTALL = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", 'pip install "homelab-dp[wandb]"'),
    "mlflow": ("mlflow", 'pip install "homelab-dp[mlflow]"'),
}
"""A ``log.report_to`` name → the module rank 0 imports and how to install it."""


def check_reporters(preset: Preset) -> None:
    """Every logger named in ``log.report_to`` is installed (found, not imported: wandb and
    mlflow take seconds to import)."""
    for name in preset.log.report_to:
        module, install = REPORTER_INSTALL[name]
        if importlib.util.find_spec(module) is None:
            raise PresetError(
                f'log.report_to: "{name}" is named, but the {module} package is not installed',
                hint=f'{install}, or take "{name}" out of log.report_to',
            )


def check_model_folder(preset: Preset) -> None:
    """The folder has safetensors weights and a tokenizer; remote code only when allowed."""
    folder = Path(preset.model.path)
    if not any(folder.glob("*.safetensors")):
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ModelSpecError(
                f"{folder}: only pickle weights ({', '.join(pickles[:3])}); refused, never loaded",
                hint="pickle files can run code when loaded; convert the model to safetensors "
                "(save_pretrained(..., safe_serialization=True)) on a machine you trust",
            )
        raise ModelSpecError(
            f"{folder}: no weights (*.safetensors)",
            hint="model.path must be a full Hugging Face model folder, not just its config",
        )
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise ModelSpecError(
            f"{folder}: no tokenizer (tokenizer.json or tokenizer.model)",
            hint="copy the tokenizer files of the model into its folder",
        )
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("auto_map") and not preset.model.trust_remote_code:
        raise ModelSpecError(
            f"{folder / 'config.json'}: the model needs its own Python code (auto_map), "
            "and model.trust_remote_code is false",
            hint="read the folder's .py files first; then set model.trust_remote_code = true",
        )


def check_torch_sees_cards(hardware: PlanHardware, report: HardwareReport | None) -> None:
    """A CUDA plan needs a torch that can use the probed cards: a CUDA build whose CUDA starts
    and that lists the same cards as NVML. CPU plans never import torch here."""
    if hardware.kind != "cuda" or report is None or not report.gpus:
        return
    problem = doctor.torch_mismatch(report, doctor.torch_facts())
    if problem is None:
        return
    planned = ", ".join(str(i) for i in hardware.indices) or "?"
    message, hint = problem
    gpus = "GPUs" if len(hardware.indices) > 1 else "GPU"
    raise HardwareSpecError(
        f"the plan uses {gpus} {planned}: {message}",
        f"{hint}; `homelab-dp doctor` checks the whole machine",
    )


def load_tokenizer(preset: Preset) -> Any:
    """The model's tokenizer, offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        preset.model.path,
        trust_remote_code=preset.model.trust_remote_code,
        local_files_only=True,
    )


def check_data(
    preset: Preset, max_positions: int, world_size: int, micro_batch: int
) -> tuple[int, float, float, tuple[str, ...]]:
    """Load and validate the dataset as the worker will; returns the number of training blocks
    (after any held-out split, `homelab_dp.data.eval_split`), the largest share of a block's
    tokens that are targets (what the chunked loss keeps), the blocks' attention span
    (`homelab_dp.data.blocks.attention_span`: the keys a token attends over in the fullest row;
    0, unknown, for pairs and prompts) and warnings for the user (identical preference pairs,
    left out). The eval data (data.eval_path or data.eval_fraction) is
    checked the same way: an error names its file and line or row. Preference objectives
    (dpo, orpo, kto) read pairs (`homelab_dp.data.preference_blocks`). The tokenized samples go
    into the token cache (`homelab_dp.data.token_cache`), where every rank of the run reads
    them instead of tokenizing again."""
    from homelab_dp.data.blocks import attention_span
    from homelab_dp.data.eval_split import load_preference_train_eval, load_train_eval
    from homelab_dp.data.preference_blocks import identical_warning
    from homelab_dp.data.sample_prompts import read_sample_prompts
    from homelab_dp.data.sources import source_of
    from homelab_dp.data.token_cache import TokenizerRef

    # Before the tokenizer loads: a typo in a path or id is named at once.
    source_of(preset.data)
    read_sample_prompts(preset.data.sample_prompts)  # a bad prompts file, before any spawn
    if preset.data.eval_path:
        source_of(preset.data, eval_data=True)
    # Loaded only if the token cache misses: a hit imports no transformers here (seconds).
    tokenizer = TokenizerRef(Path(preset.model.path), lambda: load_tokenizer(preset))
    if preset.train.objective == "grpo":  # prompts (`homelab_dp.data.prompt_records`)
        from homelab_dp.data.prompt_records import read_prompts

        prompts = read_prompts(preset.data.path, preset.data.split, preset.data.columns)
        completion = preset.grpo.max_completion_tokens  # the loss reads completion tokens only
        return len(prompts), completion / (preset.data.seq_len + completion), 0.0, ()
    if preset.train.objective in PREFERENCE_OBJECTIVES:
        pairs = load_preference_train_eval(
            preset.data,
            tokenizer,
            objective=preset.train.objective,
            seed=preset.train.seed,
            seq_len_limit=max_positions or None,
            min_blocks=world_size * micro_batch,
        )
        warning = identical_warning(pairs.identical, pairs.label)
        share = max(b.num_targets / (len(b.input_ids) * b.row_len) for b in pairs.train)
        return len(pairs.train), share, 0.0, (warning,) if warning else ()
    data = load_train_eval(
        preset.data,
        tokenizer,
        seed=preset.train.seed,
        seq_len_limit=max_positions or None,
        min_blocks=world_size * micro_batch,
    )
    blocks = data.train
    seq_len = max(1, int(preset.data.seq_len))
    share = max(b.num_targets for b in blocks) / seq_len
    return len(blocks), share, attention_span(blocks), ()


STOP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class SweepTag:
    """A run's place in a sweep: the sweep's id and the grid values of its point."""

    sweep_id: str
    point: dict[str, Any]
    """Dotted preset key → the value this point takes."""


def check_run_gpus(gpus: str | None) -> None:
    """``--gpus`` of a command that starts runs: only ``cpu:N``; sizes are `plan` what-ifs."""
    if gpus and not gpus.lower().startswith("cpu"):
        raise HomelabError(
            f"--gpus {gpus}: `run` uses real devices; sizes are for `plan` what-ifs",
            hint="choose GPUs with hardware.devices (e.g. --set hardware.devices=[0,1]) "
            "or run on the CPU with --gpus cpu:2",
        )


@dataclass(frozen=True)
class Prepared:
    """A run that passed every check and is ready to start."""

    preset: Preset
    planned: Planned
    resolved: Resolved
    blocks: int
    origin: ModelOrigin | None = None
    """The Hugging Face id ``preset.model.path`` was given as (the path is now its snapshot)."""
    warnings: tuple[str, ...] = ()
    """What the checks found worth saying but not refusing (the front end shows them)."""
    fit: Fit | None = None
    """``auto_fit``'s micro-batch finder answer (None without it)."""

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
        sweep: SweepTag | None = None,
        notify: str | None = None,
    ) -> RunSpec:
        """The run contract for this prepared run: the one builder of `RunSpec`. ``sweep``:
        the sweep it is a point of; ``notify``: the user's command for when it ends."""
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
            sweep_id=sweep.sweep_id if sweep else None,
            sweep_point=dict(sweep.point) if sweep else {},
            notify=notify or None,
        )


class RunController:
    """Everything the front ends do with runs."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = (root or runs_root()).absolute()

    # ------------------------------------------------------------------ lookup
    def run_dir(self, run_id: str) -> Path:
        """The folder of a run by id, unique id prefix or folder path, wherever it lives: the
        per-user run index, this root or ./runs (`runs.folder.run_index.find_run`). Raises a
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
        auto_fit: bool = False,
    ) -> Prepared:
        """Preflight in this process: preset, loggers, plan, torch for a CUDA plan, model
        folder (a model id's snapshot, downloaded when missing), data. Raises HomelabError.
        ``queue``: the run will wait for its cards, so it is planned on them idle; otherwise
        devices another run is using refuse it (unless ``force``). ``auto_fit``: the run takes
        the largest micro-batch that fits (`app.plan.auto_fit_preset`; ``Prepared.fit``: which)."""
        preset = open_preset(preset_ref, overrides)
        check_reporters(preset)  # a logger not installed: before the plan
        check_run_gpus(gpus)
        fit = None
        if auto_fit:
            fitted = auto_fit_preset(preset, gpus)
            preset, fit = fitted.preset, fitted.fit
        planned = make_plan(preset, gpus)
        preset = planned.preset  # data.pack off for a model with recurrent layers
        if gpus:  # cpu:N — check the count against this machine's cores
            cpu_hardware(planned.hardware.world_size, planned.hardware.min_memory, "run")
        hw = planned.hardware
        if queue:
            planned = on_idle_cards(planned, gpus)
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
        check_torch_sees_cards(planned.hardware, planned.report)
        # A model id was planned from its config.json; the run needs the whole snapshot, and
        # its workers (and any resume) get the local folder, never the id.
        preset, origin = with_local_model(preset, self.root)
        planned = replace(planned, preset=preset)
        check_model_folder(preset)
        ws = p.world_size * nnodes  # multi-node: every node runs the same devices
        data_ranks = ws // p.sequence_parallel  # a split sequence's ranks share its blocks
        blocks, share, span, warnings = check_data(preset, planned.spec.max_positions, data_ranks,
                                                   p.micro_batch)  # fmt: skip
        # The plan chose with every token taken as a target and every sample seq_len long; the
        # run records its estimate for this data (the chunked loss keeps only target rows, each
        # sample attends to itself alone), which `measure` compares.
        planned = replace(planned, plan=with_target_share(planned, share, span))
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
            sequence_parallel=p.sequence_parallel,
            tiled_mlp=p.chosen.tiled_mlp,
        )
        return Prepared(preset, planned, resolved, blocks, origin, warnings, fit)

    # ------------------------------------------------------------------ starting
    def start(
        self,
        prepared: Prepared,
        rendezvous: Rendezvous | None = None,
        *,
        auto_fit: bool = False,
        queue: bool = False,
        force: bool = False,
        sweep: SweepTag | None = None,
        notify: str | None = None,
    ) -> str:
        """Create the run folder and start its keeper in the background; return the run id.

        ``auto_fit``: when a rank runs out of memory, the keeper resumes the run with
        planning's next batch (smaller micro-batch, more accumulation, same effective batch; or
        activation checkpointing; `planning.batch_shape`) by itself, up to `MAX_OOM_RETRIES` times.
        ``queue``: the run is created "queued" and its keeper starts it when its devices are
        free (`homelab_dp.runs.run_queue`). Otherwise a start on devices another run is using is
        refused, unless ``force``. ``sweep``: the sweep this run is a point of (`app.sweep`);
        ``notify``: the command its keeper runs once when it ends (`supervise.notifier`).
        """
        rendezvous = rendezvous or Rendezvous()
        check_port(rendezvous)
        name = Path(prepared.preset.source).stem if prepared.preset.source else "run"
        run_id = new_run_id(name)
        spec = prepared.run_spec(run_id, rendezvous, auto_fit=auto_fit, sweep=sweep, notify=notify)
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
            [sys.executable, "-m", "homelab_dp.supervise.keeper", str(run_dir)],
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
        notify: str | None = None,
    ) -> str:
        """Continue a stopped or failed run from its newest complete checkpoint.

        ``queue`` (and always for a run interrupted while queued: it never started) puts it in
        the queue; otherwise devices another run is using refuse it, unless ``force``.
        ``notify``: a new notification command (None keeps the one the run was started with)."""
        run_dir = self.run_dir(run_id)
        spec = read_run_spec(run_dir)  # a damaged run says so before anything else
        settle(run_dir)
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
        if notify:
            spec = replace(spec, notify=notify)
        status = "queued" if queued else "starting"
        step = None if state.get("queued_only") else resume_step(run_dir)
        how = ("" if step is None else f"from checkpoint step {step}" if step
               else "from step 1: it has no usable checkpoint")  # fmt: skip
        before = {name: _read_bytes(run_dir / name) for name in ("spec.json", "state.json")}
        events_size = file_size(run_dir / "events.jsonl")
        try:  # all of it or none: a full disk leaves the run as it was, resumable later
            write_run_spec(run_dir, spec.relaunched(rendezvous or Rendezvous()))
            update_state(
                run_dir,
                status=status,
                reason=("queued again" if queued else "resuming") + (f" {how}" if how else ""),
                resume_from=step,
                attempt=int(state.get("attempt", 1)) + (0 if queued else 1),
                queued_only=None,
                ended=None,
                stop_requested=None,  # a stop of its queued turn before is no stop of this one
                pids={"keeper": None, "workers": [], "agent": None, "monitor": None},
            )
            append_event(run_dir, StateEvent(status=status, resume=True, reason=how or None))
        except OSError as exc:
            _restore(run_dir, before, events_size)
            raise write_error(run_dir, exc, "resume it") from None
        self._spawn_keeper(run_dir)
        return run_dir.name

    # ------------------------------------------------------------------ stopping
    def stop(self, run_id: str, timeout: float = STOP_TIMEOUT_S) -> dict[str, Any]:
        """Graceful stop: the keeper tells every rank; they agree, checkpoint and exit."""
        run_dir = self.run_dir(run_id)
        settle(run_dir)
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
        # Read by whoever settles the run if its keeper dies of this very signal; on a full
        # disk the signal still stops it (the keeper records why).
        with contextlib.suppress(OSError):
            update_state(run_dir, stop_requested=time.time())
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
        return view_of(run_dir)

    def new_view(self, run_dir: Path) -> RunView:
        """An empty view of the run, with what its run spec says (`runs.run_view.new_view`)."""
        return new_view(run_dir)

    def tail(self, run_id: str) -> RunTail:
        return RunTail(self.run_dir(run_id))

    def status(self, run_id: str) -> dict[str, Any]:
        """The `status --json` document: state, progress and final figures."""
        run_dir = self.run_dir(run_id)
        settle(run_dir)
        return summarize(run_dir, self._fold(run_dir), current_state(run_dir))

    def list_runs(self, sweep: str | None = None) -> list[dict[str, Any]]:
        """Every known run (index, root, ./runs), newest first (`runs --json`). Each row has
        ``path``, ``exists`` and ``sweep_id``; a folder that has gone, or cannot be read, is a
        row that says so (``status`` null, ``reason``), never an error. ``sweep``: only the
        runs of that sweep (`runs --sweep ID`)."""
        rows = [self._row(run) for run in known_runs(self.root)]
        if sweep is not None:
            rows = [r for r in rows if r.get("sweep_id") == sweep]
        return sorted(rows, key=lambda r: r.get("created") or 0, reverse=True)

    def sweep_runs(self, sweep_id: str) -> list[Path]:
        """The folders of a sweep's runs, in the order they were queued (oldest first)."""
        rows = self.list_runs(sweep_id)
        return [Path(r["path"]) for r in sorted(rows, key=lambda r: r.get("created") or 0)]

    def forget_gone(self) -> list[str]:
        """Drop the runs whose folder has gone from the per-user index; their ids."""
        return [run.id for run in forget_gone()]

    def _row(self, run: IndexedRun) -> dict[str, Any]:
        """One run of `list_runs`: its summary; for a folder that has gone, status null; for a
        folder that is there but cannot be read (damaged), status "damaged" and the reason."""
        reason, status = "folder gone", None
        if run.exists:
            try:
                settle(run.path)
                state = current_state(run.path)
                sweep_id = read_run_spec(run.path).sweep_id
                doc = summarize(run.path, self._fold(run.path), state)
                return {**doc, "exists": True, "sweep_id": sweep_id}
            except (OSError, ValueError, KeyError, TypeError, HomelabError) as exc:
                reason, status = str(exc), "damaged"
        return {"run_id": run.id, "path": str(run.path), "exists": run.exists, "status": status,
                "reason": reason, "created": run.created, "sweep_id": None}  # fmt: skip


def settle(run_dir: Path) -> None:
    """A run whose keeper died without its last word gets it now, from this reader
    (`supervise.keeper.settle_dead_run`: final state, benchmarks, notification, once)."""
    with contextlib.suppress(OSError, ValueError, HomelabError):  # damaged: readers see it
        settle_dead_run(run_dir)


def _read_bytes(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _restore(run_dir: Path, before: dict[str, bytes | None], events_size: int) -> None:
    """Put back files a failed write may have replaced, and cut events.jsonl back to its size
    before (a line half appended); best effort: atomic writes that failed left the old file
    in place and no temporary behind."""
    with contextlib.suppress(OSError):
        if file_size(run_dir / "events.jsonl") > events_size:
            os.truncate(run_dir / "events.jsonl", events_size)
    for name, data in before.items():
        path = run_dir / name
        if data is not None and _read_bytes(path) != data:
            with contextlib.suppress(OSError):
                path.write_bytes(data)


def write_error(run_dir: Path, exc: OSError, doing: str) -> HomelabError:
    """A write to the run folder that failed, in words: the file, why, and what to do."""
    where = exc.filename or run_dir
    why = exc.strerror or str(exc)
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    return RunStateError(
        f"run {run_dir.name}: cannot write {where} ({why}); the run is left as it was",
        hint=f"free space on the disk of {run_dir} (df -h), then {doing} again"
        if full
        else f"make {run_dir} writable, then {doing} again",
    )


def use_runs_root(folder: str) -> None:
    """Make ``folder`` (``--runs DIR``) the runs root of this process and of what it starts: it
    sets $HOMELAB_DP_RUNS, which the controller and `runs.model_ref` read. The folder is created
    0700; one that cannot be raises a HomelabError naming it, before anything starts."""
    os.environ[RUNS_ENV] = str(open_runs_root(folder, "--runs"))


def rendezvous_for(nnodes: int, node_rank: int, master_addr: str, master_port: int) -> Rendezvous:
    """The rendezvous ``--nnodes``, ``--node-rank``, ``--master-addr`` and ``--master-port`` ask
    for, checked before anything is prepared (a taken port included). Raises HomelabError."""
    if nnodes < 1 or not 0 <= node_rank < nnodes:
        raise HomelabError(
            f"--node-rank {node_rank}: must be between 0 and --nnodes - 1 ({nnodes - 1})",
            hint="number the machines 0, 1, … and start the same command on each",
        )
    rendezvous = Rendezvous(nnodes, node_rank, master_addr, master_port)
    check_port(rendezvous)
    return rendezvous


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
