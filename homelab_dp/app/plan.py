"""From a preset to a plan: choose the devices (probe or what-if) and run the planner.

Shared by the CLI, the TUI and the run controller; imports no torch.

What `homelab-dp measure` stored for the hardware a plan is for (the calibration lookup).

The fingerprint names the devices, driver and torch version; a what-if GPU size has none.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from homelab_dp.app.model_specs import model_spec
from homelab_dp.app.task_files import check_tasks
from homelab_dp.byte_units import format_bytes
from homelab_dp.errors import HardwareSpecError, ModelSpecError, PresetError
from homelab_dp.hub.hub_models import looks_like_hub_id
from homelab_dp.planning.links import (
    LinkSpeed,
    gloo_link,
    parse_network,
    read_cached_gloo,
    ring_link,
    write_cached_gloo,
)
from homelab_dp.planning.lora_target_check import check_lora_targets
from homelab_dp.planning.memory.device_memory import assumed_overhead
from homelab_dp.planning.memory.memory_calibration import (
    CalibrationStore,
    HardwareCalibration,
    fingerprint,
    torch_version,
)
from homelab_dp.planning.model_spec import ModelSpec
from homelab_dp.planning.plan_hardware import PlanDevice, PlanHardware, parse_gpus_spec
from homelab_dp.planning.plan_result import Fit
from homelab_dp.planning.planner import Plan, plan, with_host
from homelab_dp.planning.recurrent_packing import model_recurrent_kinds, packing_decision
from homelab_dp.planning.sample_cost import sample_plan
from homelab_dp.planning.sequence_split import with_degree
from homelab_dp.planning.speed_calibration import ComputeRate, SpeedStore
from homelab_dp.planning.speed_plan import with_predictions
from homelab_dp.planning.time_model import cpu_threads
from homelab_dp.presets.preset import Preset, apply_overrides, preset_from_dict
from homelab_dp.probe import nvml
from homelab_dp.probe.hardware import (
    GpuInfo,
    GpuProcess,
    HardwareReport,
    mig_off,
    mig_on,
    mig_slice,
    trained_pcie_link,
)
from homelab_dp.runs.folder.run_index import known_runs
from homelab_dp.runs.folder.run_state import read_state, recorded_pids
from homelab_dp.runs.model_ref import config_folder, run_result
from homelab_dp.vocabulary import ACTIVE_STATUSES


@dataclass(frozen=True)
class Planned:
    """A plan with what it was made from."""

    preset: Preset
    spec: ModelSpec
    hardware: PlanHardware
    plan: Plan
    report: HardwareReport | None
    """The probe, when the devices came from it (None for a what-if --gpus plan)."""
    link: LinkSpeed | None = None
    """The link the time model priced the plan's communication at."""


def cpu_hardware(nproc: int, ram_total: int, source: str) -> PlanHardware:
    """``nproc`` CPU processes sharing the host RAM."""
    cores = os.cpu_count() or 1
    if nproc > cores:
        raise PresetError(
            f"hardware.nproc: {nproc} processes but this machine has {cores} CPU cores",
            hint=f"set hardware.nproc to at most {cores} (e.g. --set hardware.nproc={cores})",
        )
    per = ram_total // nproc
    return PlanHardware(
        "cpu", tuple(PlanDevice(f"cpu process {i}", per) for i in range(nproc)), source=source
    )


def select_hardware(preset: Preset, gpus: str | None) -> tuple[PlanHardware, HardwareReport | None]:
    """The devices to plan for: a what-if ``--gpus`` spec, else the preset's choice of probed ones.

    ``hardware.devices`` names GPUs by NVML index, the number `homelab-dp probe` shows (PCI bus
    order, as nvidia-smi counts), never by a CUDA ordinal; ``"auto"`` is every GPU the probe
    reports. A user's ``CUDA_VISIBLE_DEVICES`` restricts the probe (`homelab_dp.probe.visible_gpus`):
    only the GPUs it leaves visible can be planned, still under their NVML indices, and naming
    a hidden one is a `HardwareSpecError`. The plan keeps each GPU's UUID, which the run puts in
    ``CUDA_VISIBLE_DEVICES`` (`homelab_dp.supervise.launcher.worker_env`).

    Probed cards carry their free memory and the processes holding memory on them, so the
    planner budgets what is free (`homelab_dp.planning.plan_reasons`); a process that belongs to a
    homelab-dp run is marked with its run id. What-if cards are budgeted whole.
    """
    if gpus:
        host_ram = nvml.host_info().ram_total
        return parse_gpus_spec(gpus, host_ram), None
    devices = preset.hardware.devices
    if devices == "cpu":
        host = nvml.host_info()
        return cpu_hardware(preset.hardware.nproc, host.ram_total, "preset: cpu"), None
    report = nvml.probe()
    if not report.gpus:
        if isinstance(devices, list):
            raise HardwareSpecError(
                f"hardware.devices: GPUs {devices} asked for, but no GPU was found",
                hint=(report.notice or "") + ' Use devices = "cpu" or plan with --gpus.',
            )
        return cpu_hardware(preset.hardware.nproc, report.host.ram_total, "probe: no GPU"), report
    by_index = {g.index: g for g in report.gpus}
    indices = list(by_index) if devices == "auto" else devices
    hidden = [i for i in indices if i in report.hidden_gpus]
    if hidden:
        raise HardwareSpecError(
            f"hardware.devices: GPU {hidden} hidden by CUDA_VISIBLE_DEVICES="
            f"{report.visible_devices!r} (visible: {sorted(by_index)})",
            hint="name visible GPUs by the index `homelab-dp probe` shows, or unset "
            "CUDA_VISIBLE_DEVICES (or add the card to it)",
        )
    missing = [i for i in indices if i not in by_index]
    if missing:
        raise HardwareSpecError(
            f"hardware.devices: no GPU with index {missing} (found {sorted(by_index)})",
            hint="`homelab-dp probe` lists the GPUs and their indices",
        )
    gpus = [by_index[i] for i in indices]
    if len(gpus) == 1 and mig_on(gpus[0]):
        return _mig_hardware(gpus[0], report), report
    check_no_mig(gpus)
    ours = our_pids() if any(g.processes for g in gpus) else {}
    chosen = tuple(
        PlanDevice(
            g.name,
            g.memory_total,
            g.compute_capability,
            g.memory_free,
            _mark_ours(g.processes, ours),
            *trained_pcie_link(g),  # what offloaded copies cross (core.offload)
        )
        for g in gpus
    )
    uuids = tuple(g.uuid for g in gpus if g.uuid)
    hardware = PlanHardware(
        "cuda",
        chosen,
        source="probe",
        indices=tuple(indices),
        uuids=uuids if len(uuids) == len(gpus) else (),
        notes=tuple(_mig_pending_note(g) for g in gpus if g.mig and g.mig.pending),
    )
    return hardware, report


def _card(g: GpuInfo) -> str:
    return f"GPU {g.index} ({g.name})"


def check_no_mig(gpus: list[GpuInfo]) -> None:
    """Several cards, one with MIG on: refused. CUDA gives a process one MIG slice, and NCCL
    does not run between MIG instances, so no run can span a MIG slice and another device."""
    mig = [g for g in gpus if mig_on(g)]
    if not mig:
        return
    whole = [g.index for g in gpus if not mig_on(g)]
    cards = " and ".join(_card(g) for g in mig)
    has = "has" if len(mig) == 1 else "have"
    others = ""
    if whole:
        others = f", or the cards without MIG: hardware.devices=[{','.join(map(str, whole))}]"
    raise HardwareSpecError(
        f"hardware.devices: {cards} {has} MIG on, and a run on {len(gpus)} devices cannot use a "
        "MIG slice: CUDA gives a process one MIG slice, and NCCL does not run between MIG "
        "instances",
        hint=f"turn MIG off to train on the whole card: {mig_off(mig[0].index)}; or plan on one "
        f"MIG slice: hardware.devices=[{mig[0].index}]{others} (e.g. --set "
        f"hardware.devices=[{whole[0] if whole else mig[0].index}])",
    )


def _mig_hardware(g: GpuInfo, report: HardwareReport) -> PlanHardware:
    """One card with MIG on, planned as the one MIG slice a process gets (`mig_slice`): its
    memory, its MIG UUID (what the run puts in CUDA_VISIBLE_DEVICES), never the whole card."""
    chosen = mig_slice(g, report.visible_mig)
    if chosen is None:
        none = "no MIG instance" if not g.mig or not g.mig.slices else "no MIG instance NVML names"
        raise HardwareSpecError(
            f"hardware.devices: {_card(g)} has MIG on but {none}: CUDA cannot run on it",
            hint=f"create one: sudo nvidia-smi mig -i {g.index} -cgi <profile> -C (`nvidia-smi "
            f"mig -i {g.index} -lgip` lists the profiles), or turn MIG off: {mig_off(g.index)}",
        )
    assert chosen.uuid is not None  # mig_slice picks only slices CUDA can be told
    slices = g.mig.slices if g.mig else ()
    why = (
        "named by CUDA_VISIBLE_DEVICES"
        if chosen.uuid == report.visible_mig
        else "the most free memory" if len(slices) > 1 else "its only one"
    )  # fmt: skip
    free = f", {format_bytes(chosen.memory_free)} free" if chosen.memory_free is not None else ""
    note = (
        f"MIG: {_card(g)} is split into {len(slices)} MIG slice{'s' if len(slices) > 1 else ''}; "
        f"the plan uses slice {chosen.index} ({chosen.profile}, {chosen.uuid}, "
        f"{format_bytes(chosen.memory_bytes)}{free}: {why}) in one process, never the whole "
        "card: CUDA gives a process one MIG slice, and NCCL does not run between them. For the "
        f"whole card turn MIG off: {mig_off(g.index)}; for another slice, set CUDA_VISIBLE_DEVICES "
        "to its MIG UUID (`homelab-dp probe` lists them)."
    )
    device = PlanDevice(
        chosen.name or f"{g.name} MIG {chosen.profile}",
        chosen.memory_bytes,
        g.compute_capability,
        chosen.memory_free,
        None,  # NVML lists the card's processes, not which slice each one is on
        *trained_pcie_link(g),
    )
    return PlanHardware(
        "cuda", (device,), source="probe", indices=(g.index,), uuids=(chosen.uuid,), notes=(note,)
    )


def _mig_pending_note(g: GpuInfo) -> str:
    return (
        f"MIG: {_card(g)} turns MIG on at its next reset; until then CUDA sees the whole card, "
        "which this plan is for (after it, a plan uses one MIG slice)."
    )


def our_pids() -> dict[int, str]:
    """The pids of the homelab-dp runs active now (keeper, agent, monitor, workers), each with
    its run id: every run the per-user index knows (`homelab_dp.runs.folder.run_index.known_runs`)."""
    out: dict[int, str] = {}
    for run in known_runs():
        state = read_state(run.path) if run.exists else {}
        if state.get("status") in ACTIVE_STATUSES:  # a finished run's pids may be reused
            for pid in recorded_pids(state):
                out[pid] = run.id
    return out


def _mark_ours(
    processes: tuple[GpuProcess, ...] | None, ours: dict[int, str]
) -> tuple[GpuProcess, ...] | None:
    """``processes`` with the run id set on each that belongs to one of our runs."""
    if not processes:
        return processes
    return tuple(replace(p, run_id=ours.get(p.pid)) for p in processes)


def preset_for_model(model: str, overrides: list[str] | None = None) -> Preset:
    """A preset made in memory to plan ``model`` (a model folder, a Hugging Face id, or a run
    by id, unique id prefix or folder: its result) with every other field at its default and
    ``overrides`` (``--set``) applied: `plan --model`.
    It has no data file (planning reads none), so it can be planned, never run."""
    path = Path(os.path.expanduser(model))
    if run_result(model, field="--model") is not None:  # a run (id, prefix, folder): its result
        pass
    elif path.exists():
        model = str(path.absolute())
    elif not looks_like_hub_id(model):
        raise ModelSpecError(
            f"--model {model}: no such folder, and not a Hugging Face id (org/name)",
            hint="give a local model folder (with config.json) or an id such as Qwen/Qwen2.5-0.5B",
        )
    # data.path is required of a preset; planning reads no data, so it is blanked after checks
    preset = preset_from_dict({"model": {"path": model}, "data": {"path": "-"}})
    preset = apply_overrides(preset, overrides or [])
    return replace(preset, data=replace(preset.data, path=""))


def check_bench_tasks(preset: Preset) -> None:
    """``train.bench_tasks`` checked as `homelab-dp bench` checks ``--tasks`` (known names,
    task files readable and, without ``train.bench_trust_code``, free of code), so a run whose
    benchmarks would fail after training is refused before it starts."""
    if preset.train.bench_tasks:
        check_tasks(list(preset.train.bench_tasks), trust_code=preset.train.bench_trust_code,
                    field_name="train.bench_tasks")  # fmt: skip


def make_plan(
    preset: Preset,
    gpus: str | None = None,
    *,
    find_micro_batch: bool = False,
    find_seq_len: bool = False,
    fetch: bool = True,
    network: str | None = None,
    measure_link: bool = False,
) -> Planned:
    """Plan ``preset`` (paths already resolved) on the probed or what-if hardware.

    A model given by Hugging Face id is planned from its config.json alone: the cached one,
    else downloaded (only that file) when ``fetch`` and online (`runs.model_ref`).

    What `homelab-dp measure` stored for this hardware corrects the overhead terms and is shown
    beside the estimate. ``find_micro_batch``: the largest micro-batch that fits, accumulation
    keeping the preset's effective batch (`homelab_dp.planning.planner`). ``find_seq_len``: the
    longest data.seq_len that fits, for the preset's choice and every candidate, what limits it
    and what would lift it (`homelab_dp.planning.seq_len_search`), in the plan's reasons and its
    ``seq_len_finder``. The plan's host RAM is checked against this machine's (`host_available`).

    The time model predicts every option's step time and scaling (`predict_speed`):
    ``network`` (``--network``) prices communication over that Ethernet between machines;
    ``measure_link``: on the CPU, measure gloo's bandwidth once if this host has not yet
    (`homelab-dp plan` does; a run's preparation uses the cache or the stated default).
    """
    from homelab_dp.planning.planner import plan_largest_micro_batch

    link = parse_network(network) if network else None  # bad input fails before the probe
    check_bench_tasks(preset)  # they run after training: an error then would be too late
    folder = config_folder(preset.model.path, preset.model.revision, fetch=fetch)
    spec = model_spec(
        folder, trust_remote_code=preset.model.trust_remote_code, text_only=preset.model.text_only
    )
    if preset.train.method != "full":  # a name that picks nothing fails in rank 0: refuse it now
        check_lora_targets(spec, preset.lora.target_modules, preset.source)
    # Recurrent layers (Gated DeltaNet, Mamba-2, short convolutions): planned and run unpacked.
    kinds = model_recurrent_kinds(spec, _config(folder))
    packing = packing_decision(preset.data.pack, kinds, spec.model_type)
    if packing.pack != preset.data.pack:
        preset = replace(preset, data=replace(preset.data, pack=packing.pack))
    hardware, report = select_hardware(preset, gpus)
    calibration = hardware_calibration(hardware, report)
    make = plan_largest_micro_batch if find_micro_batch else plan
    made = make(spec, preset, hardware, calibration)
    # train.sequence_parallel = "auto" resolved by the plan: everything after (the host RAM,
    # the speed, the run's spec) takes the degree it chose.
    preset = with_degree(preset, made.sequence_parallel)
    planned = with_host(made, preset, host_available(gpus, hardware, report))
    if find_seq_len:
        from homelab_dp.planning.seq_len_search import find_seq_len as seq_len_search

        found = seq_len_search(spec, preset, hardware, calibration)
        planned = replace(planned, seq_len_finder=found,
                          reasons=(*planned.reasons, *found.reasons()))  # fmt: skip
    link = link or plan_link(hardware, report, measure=measure_link)
    planned = predict_speed(planned, preset, link)
    if packing.reason:  # after the line that names the model
        planned = replace(planned, reasons=(*planned.reasons[:1], packing.reason,
                                            *planned.reasons[1:]))  # fmt: skip
    return Planned(preset, spec, hardware, planned, report, link)


@dataclass(frozen=True)
class AutoFit:
    """``--auto-fit`` before a launch: the preset with the batch the micro-batch finder chose."""

    preset: Preset
    """The preset with `fit`'s micro-batch and accumulation (as given when nothing fits)."""
    fit: Fit | None
    """The finder's answer; None when no option is supported (the plan explains)."""


def auto_fit_preset(preset: Preset, gpus: str | None = None) -> AutoFit:
    """The largest micro-batch that fits, accumulation keeping the preset's effective batch,
    applied to ``preset`` (`homelab_dp.planning.planner.plan_largest_micro_batch`): what
    ``run --auto-fit`` and the TUI's auto-fit launch with. The learning rate was set for the
    batch the preset asked, so a rounded-up batch keeps it as ``train.reference_batch``."""
    fit = make_plan(preset, gpus, find_micro_batch=True).plan.fit
    if fit is None or not fit.fits:
        return AutoFit(preset, fit)  # nothing fits: the plan refuses the run with its reasons
    train = replace(preset.train, micro_batch=fit.micro_batch, grad_accum=fit.grad_accum)
    if not fit.exact and not preset.train.reference_batch:
        train = replace(train, reference_batch=fit.requested_effective_batch)
    return AutoFit(replace(preset, train=train), fit)


def _config(folder: str | Path) -> dict[str, Any]:
    """The folder's config.json as read for the plan ({} when it is not a JSON object: the
    model spec has already said what is wrong with it)."""
    try:
        data = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def plan_link(hw: PlanHardware, report: HardwareReport | None, *, measure: bool) -> LinkSpeed:
    """The link the plan's collectives cross: the slowest hop between the planned cards (the
    probe's NVLink/P2P facts; what-if cards: PCIe with P2P assumed), on the CPU gloo between
    processes as measured on this host (``measure``: measured now when not cached)."""
    if hw.kind != "cpu":
        return ring_link(hw, report.links if report is not None else ())
    if hw.world_size < 2:
        return ring_link(hw)
    return gloo_link(gloo_measurement(measure))


GLOO_TIMEOUT_S = 30.0


def gloo_measurement(measure: bool) -> dict[str, Any] | None:
    """This host's cached gloo bandwidth; when absent and ``measure``, measured once in a child
    process (`homelab_dp.train.parallelism.gloo_bandwidth`: torch stays out of this process) and cached.
    None when neither: the time model then states its default."""
    host, version = socket.gethostname(), torch_version()
    cached = read_cached_gloo(host, version)
    if cached is not None or not measure:
        return cached
    try:
        done = subprocess.run(
            [sys.executable, "-m", "homelab_dp.train.parallelism.gloo_bandwidth"],
            capture_output=True, text=True, timeout=GLOO_TIMEOUT_S, check=False,
        )  # fmt: skip
        lines = done.stdout.strip().splitlines()
        doc = json.loads(lines[-1]) if done.returncode == 0 and lines else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        doc = None  # the plan still answers, with the stated default
    if not isinstance(doc, dict) or not doc.get("bytes_per_s"):
        return None
    write_cached_gloo(host, version, doc)
    return doc


def predict_speed(p: Plan, preset: Preset, link: LinkSpeed) -> Plan:
    """``p`` with the time model's predictions and advice, its compute priced at what this
    machine measured (`homelab_dp.planning.speed_calibration`), else the stated default."""
    store = SpeedStore()
    fp = p.calibration.fingerprint if p.calibration else None
    model = p.spec.summary()  # as the plan's "model" block, which record_speed keys by
    kind = p.hardware.kind
    threads = cpu_threads(p.world_size) if kind == "cpu" else None

    def rate_of(method: str, ckpt: bool) -> ComputeRate:
        return store.rate_for(fp, kind, model, method, ckpt, threads)

    return with_predictions(p, preset, link, rate_of)


def with_target_share(planned: Planned, share: float, span: float = 0.0) -> Plan:
    """The plan with its chosen option budgeted for data whose blocks are at most ``share``
    targets (`TrainShape.target_share`) and attend over ``span`` keys a token
    (`TrainShape.attention_span`; 0: unknown); the choice itself stays the one made for any
    data."""
    from homelab_dp.planning.planner import evaluate

    p = planned.plan
    c = p.chosen
    if share >= 1.0 and not 0 < span < p.seq_len:
        return p
    refined = evaluate(planned.spec, planned.preset, planned.hardware, c.method, c.distribution,
                       c.activation_checkpointing, p.calibration, micro_batch=p.micro_batch,
                       grad_accum=p.grad_accum, seq_len=p.seq_len, target_share=min(1.0, share),
                       attention_span=span, offload=c.offload,
                       offload_activations=c.offload_activations, tiled_mlp=c.tiled_mlp)  # fmt: skip
    return replace(p, chosen=replace(c, budget=refined.budget))


def host_available(
    gpus: str | None, hardware: PlanHardware, report: HardwareReport | None
) -> int | None:
    """The host RAM a plan may use: the probe's available RAM (else its total).

    A what-if ``--gpus cpu:N:SIZE`` has SIZE; what-if cards (``--gpus 2x24GiB``) sit in some
    other machine, whose RAM is not known: None, not checked.
    """
    if gpus and hardware.kind == "cuda":
        return None
    if gpus and gpus.count(":") >= 2:
        return sum(d.memory_bytes for d in hardware.devices)
    host = report.host if report is not None else nvml.host_info()
    return host.ram_available or host.ram_total


def hardware_fingerprint(hw: PlanHardware, report: HardwareReport | None) -> str | None:
    """The fingerprint of the devices a plan is for, or None for a what-if GPU size."""
    if hw.kind == "cuda":
        if report is None or not report.gpus:
            return None  # `--gpus 2x24GiB`: hardware that is not here
        names = [g.name for g in report.gpus if not hw.indices or g.index in hw.indices]
        return fingerprint(
            "cuda", device_names=names, driver=report.driver_version, torch=torch_version()
        )
    if report is not None:
        cpu = report.host.cpu_model
    else:
        from homelab_dp.probe import nvml

        cpu = nvml.host_info().cpu_model
    return fingerprint("cpu", cpu_model=cpu, torch=torch_version())


def hardware_calibration(hw: PlanHardware, report: HardwareReport | None) -> HardwareCalibration:
    """What was measured on the plan's hardware (nothing for a what-if GPU size)."""
    fp = hardware_fingerprint(hw, report)
    if fp is None:
        return HardwareCalibration(None)
    return CalibrationStore().for_hardware(fp, assumed_overhead(hw.kind, hw.world_size))


def on_idle_cards(planned: Planned, gpus: str | None) -> Planned:
    """A queued run's plan: on its cards with nothing else on them (it waits until the plan's
    memory is free), when other processes now hold some of it; else the plan as made."""
    if planned.plan.idle is None:
        return planned
    idle = planned.hardware.idle()
    fresh = plan(planned.spec, planned.preset, idle, planned.plan.calibration)
    fresh = with_host(fresh, planned.preset, host_available(gpus, idle, planned.report))
    if planned.link is not None:
        fresh = predict_speed(fresh, planned.preset, planned.link)
    return replace(planned, hardware=idle, plan=fresh)


def planned_samples(planned: Planned, expected: Any = None) -> dict[str, Any] | None:
    """What samples while training add to the planned run (`planning.sample_cost.sample_plan`):
    the ``samples`` block of `plan --json`; ``expected`` (`runs.preset_results.PresetRuns`)
    gives the steps of a run that counts epochs and the tokens/s to price them at."""
    expectation = getattr(expected, "expectation", None)
    preset, chosen = planned.preset, planned.plan.chosen
    steps = preset.train.max_steps or (expectation.steps if expectation else 0)
    return sample_plan(
        planned.spec, preset, method=chosen.method,
        activation_checkpointing=chosen.activation_checkpointing, steps=int(steps),
        train_tokens_per_s=expectation.tokens_per_s if expectation else None,
    )  # fmt: skip
