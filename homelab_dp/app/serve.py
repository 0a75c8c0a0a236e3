"""`homelab-dp serve`: from a MODEL argument to a serving plan (resolve the model, choose the
devices, plan, and pick the replicas `serve` starts: one per device that holds a copy), the
server's own checks (the API key, the host and port, the engine) and its start. Imports no torch.

The API key: ``--api-key-file PATH`` (its first line; a file other users can read is
refused) or ``$HOMELAB_DP_API_KEY``; ``--api-key KEY`` still works but is visible to every user
in the process list, so it draws a warning on stderr. The key never reaches the replicas.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import socket
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from homelab_dp.app.model_specs import model_spec
from homelab_dp.app.plan import Planned
from homelab_dp.byte_units import format_bytes
from homelab_dp.errors import HardwareSpecError, HomelabError
from homelab_dp.planning.model_spec import ModelSpec
from homelab_dp.planning.plan_hardware import PlanDevice, PlanHardware, parse_gpus_spec
from homelab_dp.planning.serve_plan import (
    CANNOT_HELP,
    DEFAULT_CONCURRENT,
    DEFAULT_CONTEXT,
    ServeDevice,
    ServePlan,
    plan_serving,
)
from homelab_dp.probe import nvml
from homelab_dp.probe.hardware import HardwareReport, mig_off, mig_on
from homelab_dp.runs.model_ref import ModelRef, resolve_model_arg

ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")


@dataclass(frozen=True)
class ReplicaDevice:
    """Where one replica runs."""

    device: str
    """"cpu", or "cuda:0": the card as the replica sees it (CUDA_VISIBLE_DEVICES leaves one)."""
    label: str
    """"cpu" or "GPU 1 (NVIDIA GeForce RTX 3090)": what /health shows as "device"."""
    cuda_visible: str | None
    """CUDA_VISIBLE_DEVICES for the replica: the card's UUID, else its NVML index; None on CPU."""
    threads: int | None
    """torch threads of a CPU replica (the cores shared between the replicas, at least 1)."""


@dataclass(frozen=True)
class ServePlanned:
    """A serving plan with what it was made for, and the replicas to start."""

    ref: ModelRef
    """The model, as `runs.model_ref.resolve_model_arg` found it."""
    spec: ModelSpec
    """Its sizes (the base's config.json for an adapter)."""
    plan: ServePlan
    """Per-replica memory and the copies that fit on each device."""
    replicas: list[ReplicaDevice]
    """The replicas to start, in device order."""
    source: str
    """Where the devices came from: "probe", "probe: no GPU", "--gpus cpu:2", "--gpus 2x24GiB"."""
    dtype: str
    """The serving dtype: "bf16", "fp16" or "fp32"."""


def parse_replicas(text: str | int) -> int | None:
    """``--replicas``: a positive count, or None for ``auto``. Raises HomelabError."""
    value = str(text).strip().lower()
    if value == "auto":
        return None
    if value.isdigit() and int(value) >= 1:
        return int(value)
    raise HomelabError(
        f"--replicas: {text!r} is not a positive number nor auto",
        hint="--replicas auto (one per device that holds a copy) or --replicas N, e.g. 2",
    )


def serve_hardware(
    gpus: str | None, *, what_if_ok: bool
) -> tuple[PlanHardware, HardwareReport | None]:
    """The devices to serve on, and the probe when it chose them.

    No ``--gpus``: the probed GPUs (NVML, or the recording named by HOMELAB_DP_FAKE_NVML), or one
    CPU process when there is none. ``--gpus cpu:N``: N CPU processes, each an equal share of
    the host RAM available (``cpu:N:SIZE``: of SIZE). A what-if card spec
    (``2x24GiB``) only where ``what_if_ok`` (a plan, not a server).
    """
    if gpus and gpus.strip().lower().startswith("cpu"):
        host = nvml.host_info()
        ram = host.ram_available or host.ram_total
        return parse_gpus_spec(gpus, ram), None
    if gpus:
        hw = parse_gpus_spec(gpus, 0)
        if not what_if_ok:
            raise HardwareSpecError(
                f"--gpus {gpus}: what-if cards can be planned, not served",
                hint=f"see the plan with `serve MODEL --plan --gpus {gpus}`; serve on this "
                "machine's GPUs without --gpus, or on CPU processes with --gpus cpu:N",
            )
        return hw, None
    report = nvml.probe()
    if not report.gpus:
        ram = report.host.ram_available or report.host.ram_total
        hw = parse_gpus_spec("cpu:1", ram)
        return PlanHardware("cpu", hw.devices, source="probe: no GPU"), report
    devices: list[PlanDevice] = []
    indices: list[int] = []
    uuids: list[str | None] = []
    for g in report.gpus:
        if mig_on(g):
            # CUDA sees a MIG card only as its slices, each a device of its own memory: a
            # replica per slice (replicas are separate processes and never talk to each other,
            # so NCCL's lack of MIG-to-MIG support does not matter here). A slice is named to
            # CUDA by its MIG UUID; one NVML gave no UUID or memory for cannot be served.
            for sl in g.mig.slices if g.mig else ():
                if sl.uuid and sl.memory_bytes:
                    name = f"{g.name} MIG {sl.profile} (slice {sl.index})"
                    devices.append(PlanDevice(name, sl.memory_bytes, g.compute_capability))
                    indices.append(g.index)
                    uuids.append(sl.uuid)
            continue
        devices.append(PlanDevice(g.name, g.memory_total, g.compute_capability))
        indices.append(g.index)
        uuids.append(g.uuid)
    named = tuple(u for u in uuids if u)
    hw = PlanHardware(
        "cuda",
        tuple(devices),
        source="probe",
        indices=tuple(indices),
        uuids=named if len(named) == len(devices) else (),
    )
    mig = [g for g in report.gpus if mig_on(g)]
    if mig and not hw.uuids:
        raise HardwareSpecError(
            "a MIG card is served by its slices' MIG UUIDs, and NVML gave no UUID for a card here",
            hint="`nvidia-smi -L` lists the UUIDs; serve on the other cards with "
            f"CUDA_VISIBLE_DEVICES, or turn MIG off: {mig_off(mig[0].index)}",
        )
    return hw, report


def serve_dtype(kind: str, preset_dtype: str, hw: PlanHardware) -> str:
    """fp32 on the CPU; on CUDA the run's dtype, "auto" being bf16 (fp16 below Ampere)."""
    if kind == "cpu" or preset_dtype == "fp32":
        return "fp32"
    if preset_dtype in ("bf16", "fp16"):
        return preset_dtype
    return "fp16" if hw.below_capability((8, 0)) else "bf16"


def serve_devices(hw: PlanHardware) -> list[ServeDevice]:
    """The planning hardware as serving devices, named as people see them."""
    out = []
    for i, d in enumerate(hw.devices):
        index = hw.indices[i] if i < len(hw.indices) else i
        name = hw.label(i) if hw.indices or hw.kind == "cpu" else f"card {i} ({d.name})"
        out.append(ServeDevice(index, name, d.memory_bytes))
    return out


def adapter_bytes(ref: ModelRef) -> int:
    """An adapter's weights as stored (0 for a full model): the replica merges it into the
    base at load, so it is alive beside the base only then; counted as that peak."""
    if not ref.is_adapter:
        return 0
    for name in ADAPTER_FILES:
        path = ref.path / name
        if path.is_file():
            return path.stat().st_size
    return 0


def plan_serve(
    model: str,
    *,
    gpus: str | None = None,
    replicas: str = "auto",
    context: int | None = None,
    concurrent: int = DEFAULT_CONCURRENT,
    what_if_ok: bool = False,
) -> ServePlanned:
    """Plan serving MODEL and pick the replica devices. Raises HomelabError for bad input and
    for a model that no device can hold (replicas cannot help it).

    ``what_if_ok``: a plan only (`serve --plan`), never a server: what-if cards (``--gpus
    2x24GiB``) are allowed, and a model that fits no device comes back with no replicas and
    the plan's reasons saying why, instead of an error."""
    wanted = parse_replicas(replicas)
    if concurrent < 1:
        raise HomelabError(f"concurrent: {concurrent} sequences", hint="plan at least 1")
    # A Hugging Face id: its local snapshot, which the replicas load (a plan needs its config)
    ref = resolve_model_arg(model, config_only=what_if_ok)
    spec = model_spec(ref.config_path)
    positions = spec.max_positions or DEFAULT_CONTEXT
    ctx = min(DEFAULT_CONTEXT, positions) if context is None else context
    if ctx < 1 or ctx > positions:
        raise HomelabError(
            f"context: {ctx} tokens, but {ref.name} has {positions} positions",
            hint=f"plan a context between 1 and {positions}",
        )
    hw, report = serve_hardware(gpus, what_if_ok=what_if_ok)
    dtype = serve_dtype(hw.kind, ref.dtype, hw)
    plan = plan_serving(spec, serve_devices(hw), weight_bytes_per_param=4 if dtype == "fp32" else 2,
                        context=ctx, concurrent=concurrent, kind=hw.kind,
                        adapter_bytes=adapter_bytes(ref))  # fmt: skip
    if report is not None and hw.kind == "cpu":
        plan.reasons.insert(0, f"No GPU found ({report.notice or 'none reported'}): serving "
                               "from one CPU process; --gpus cpu:N starts N.")  # fmt: skip
    holding = [i for i, d in enumerate(plan.devices) if d.copies_fit >= 1]
    if not holding and what_if_ok:  # a plan only: it says so itself (as `plan` does, exit 0)
        return ServePlanned(ref, spec, plan, [], hw.source, dtype)
    if not holding:
        raise HomelabError(
            f"{ref.name}: a replica needs {format_bytes(plan.per_replica_bytes)} "
            f"(weights, KV cache of {concurrent} × {ctx} tokens, overhead), more than any "
            f"{'card' if hw.kind == 'cuda' else 'CPU process'} here has "
            f"({format_bytes(max(d.memory_bytes for d in plan.devices))} the largest)"
            + (": its KV cache is what does not fit" if plan.max_concurrent >= 1
               else ": " + CANNOT_HELP),
            hint=f"serve fewer sequences at once (--concurrent {plan.max_concurrent}) or a "
            "shorter context (--context); `serve --plan` shows the breakdown"
            if plan.max_concurrent >= 1
            else "quantize it or shard it; `serve --plan` shows the breakdown",
        )  # fmt: skip
    if wanted is not None and wanted > len(holding):
        unit = "GPU" if hw.kind == "cuda" else "CPU process"
        raise HomelabError(
            f"--replicas {wanted}: only {len(holding)} {unit}(s) here can hold a copy of "
            f"{ref.name}",
            hint="use --replicas auto"
            + (f" or --gpus cpu:{wanted}" if hw.kind == "cpu" else " (one replica per card)"),
        )
    chosen = holding if wanted is None else holding[:wanted]
    cores = os.cpu_count() or 1
    picked = []
    for i in chosen:
        d = plan.devices[i]
        if hw.kind == "cpu":
            picked.append(ReplicaDevice("cpu", "cpu", None, max(1, cores // len(chosen))))
        else:
            visible = hw.uuids[i] if hw.uuids else str(d.index)
            picked.append(ReplicaDevice("cuda:0", d.name, visible, None))
    return ServePlanned(ref, spec, plan, picked, hw.source, dtype)


def plan_serving_result(planned: Planned) -> ServePlan:
    """The serving plan of a training plan's result on the same devices (the TUI's Plan
    screen): the model's spec, the run's dtype, a LoRA/QLoRA adapter's fp32 weights beside the
    16-bit base, the default context and concurrency. No model folder is read."""
    hw, spec = planned.hardware, planned.spec
    dtype = serve_dtype(hw.kind, planned.preset.model.dtype, hw)
    j = planned.plan.to_json()
    adapter = j["model"]["trainable_params"] * 4 if j["method"] != "full" else 0
    return plan_serving(spec, serve_devices(hw), weight_bytes_per_param=4 if dtype == "fp32" else 2,
                        context=min(DEFAULT_CONTEXT, spec.max_positions or DEFAULT_CONTEXT),
                        concurrent=DEFAULT_CONCURRENT, kind=hw.kind, adapter_bytes=adapter)  # fmt: skip


# -- the server's own checks and its start

KEY_ENV = "HOMELAB_DP_API_KEY"


def read_key_file(path: Path) -> str:
    """The API key in ``path`` (its first line), or an error when the file is missing, empty,
    or readable or writable by other users."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise HomelabError(
            f"--api-key-file {path}: no such file",
            hint="write the key on the file's first line (chmod 600 it)",
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise HomelabError(
            f"--api-key-file {path}: cannot be read ({exc})", hint="a text file, chmod 600"
        ) from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise HomelabError(
            f"--api-key-file {path}: other users can read or write it "
            f"(mode {stat.S_IMODE(mode):o})",
            hint=f"chmod 600 {path}",
        )
    lines = text.splitlines()
    key = lines[0].strip() if lines else ""
    if not key:
        raise HomelabError(
            f"--api-key-file {path}: the first line is empty", hint="write the key on it"
        )
    return key


def api_key(key_file: Path | None, key: str | None) -> str | None:
    """The API key: ``key_file`` (--api-key-file), ``key`` (--api-key, with a warning on
    stderr) or $HOMELAB_DP_API_KEY."""
    if key_file is not None and key:
        raise HomelabError(
            "--api-key and --api-key-file both give the key", hint="keep --api-key-file"
        )
    if key_file is not None:
        return read_key_file(key_file)
    if key:
        sys.stderr.write(
            "warning: --api-key is visible to every user of this machine in the process list\n"
            f"hint: set {KEY_ENV} or use --api-key-file PATH (chmod 600) instead\n"
        )
        return str(key)
    return os.environ.get(KEY_ENV) or None


def is_loopback(host: str) -> bool:
    """Whether ``host`` is only reachable from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to anything


def check_listen(host: str, port: int, key: str | None, *, plan_only: bool) -> None:
    """A host off loopback needs an API key (unless only the plan is asked for); the port is a
    port. Raises HomelabError."""
    if not plan_only and not is_loopback(host) and not key:
        raise HomelabError(
            f"--host {host} is reachable from other machines and there is no --api-key",
            hint="add --api-key SECRET (clients send `Authorization: Bearer SECRET`), "
            "or bind 127.0.0.1",
        )
    if not 0 <= port <= 65535:
        raise HomelabError(f"--port {port}: not a port", hint="a number from 1 to 65535")


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, or the error of a taken port / unknown host."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise HomelabError(
            f"--host {host}: not an address of this machine ({exc.strerror})",
            hint="use 127.0.0.1 (this machine only) or 0.0.0.0 (every interface)",
        ) from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT, not a live listener
    try:
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise HomelabError(
            f"--port {port}: cannot listen on {host}:{port} ({exc.strerror})",
            hint="another program holds that port: pick another with --port, or stop it",
        ) from None
    return sock


def check_engine(engine: str, devices: list[str], gpu_memory_utilization: float | None) -> None:
    """vLLM replicas need vllm importable and CUDA cards; transformers runs anywhere, and
    ``gpu_memory_utilization`` is vLLM's. Raises HomelabError."""
    if engine == "transformers":
        if gpu_memory_utilization is not None:
            raise HomelabError(
                "--gpu-memory-utilization is for vLLM replicas",
                hint="add --engine vllm, or drop --gpu-memory-utilization",
            )
        return
    if importlib.util.find_spec("vllm") is None:
        raise HomelabError(
            "--engine vllm: vllm is not installed",
            hint="`pip install vllm` on a machine with NVIDIA GPUs, or drop --engine "
            "(transformers replicas work everywhere)",
        )
    if not any(d.startswith("cuda") for d in devices):
        raise HomelabError(
            "--engine vllm: vLLM replicas need CUDA GPUs, and these replicas run on the CPU",
            hint="drop --engine (transformers replicas run on the CPU)",
        )


def start_serving(
    planned: ServePlanned,
    *,
    host: str,
    port: int,
    key: str | None,
    engine: str = "transformers",
    max_batch: int | None = None,
    context: int | None = None,
    gpu_memory_utilization: float | None = None,
    request_timeout: float = 600.0,
) -> int:
    """Check the engine, bind ``host:port`` here (so nobody takes the port in between) and serve
    the planned replicas behind the OpenAI front until it is stopped; its exit code.
    Raises HomelabError before anything starts."""
    check_engine(engine, [r.device for r in planned.replicas], gpu_memory_utilization)
    sock = bind(host, port)
    # The serving front (aiohttp) is imported only once a server starts: `serve --plan` and the
    # TUI's plan screen, which plan through this module, never load it.
    from homelab_dp.serving.front.openai_server import serve
    from homelab_dp.serving.front.replica_supervisor import ReplicaLaunch

    ref = planned.ref
    launches = [
        ReplicaLaunch(r.device, r.label, r.cuda_visible, r.threads) for r in planned.replicas
    ]
    return serve(
        str((ref.run_dir or ref.path).absolute()),
        ref.name,
        launches,
        host=host,
        port=sock.getsockname()[1],
        api_key=key,
        max_batch=max_batch,
        sock=sock,
        engine=engine,
        context=context,
        gpu_memory_utilization=gpu_memory_utilization,
        request_timeout=request_timeout,
    )
