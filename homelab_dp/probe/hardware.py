"""What the machine has (probe results) and what a plan is made for (planning hardware).

Pure data and parsing; the probing itself lives in `homelab_dp.probe`.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, replace
from typing import Literal

from homelab_dp.errors import HardwareSpecError

GiB = 1024**3
MiB = 1024**2

BF16_MIN_CAPABILITY = (8, 0)
"""The oldest compute capability with bf16 arithmetic (Ampere); older cards compute in fp16."""

DeviceKind = Literal["cuda", "cpu"]

FREE_MARGIN_MIN = 256 * MiB
FREE_MARGIN_SHARE = 0.02
"""A local card's budget keeps this much of its free memory back (the larger of the two):
other processes' memory moves between the probe and the run's peak."""


def free_margin(total: int) -> int:
    """What a plan leaves of a local card's free memory: max(256 MiB, 2% of the card)."""
    return max(FREE_MARGIN_MIN, int(FREE_MARGIN_SHARE * total))


@dataclass(frozen=True)
class GpuProcess:
    """A process that holds memory on a GPU, as NVML lists it (compute and graphics)."""

    pid: int
    name: str | None
    """Its name (psutil, /proc/PID/comm, or a recording's); None when it cannot be read
    (another PID namespace or user, or it has exited)."""
    used_bytes: int | None
    """Device memory it holds; None where NVML says "not available" (no permission, WDDM)."""
    kind: str = "compute"
    """How NVML lists it: "compute", "graphics" or "compute+graphics"."""
    run_id: str | None = None
    """The homelab-dp run whose keeper, agent or worker it is; set by planning, never by the
    probe (which does not read run folders)."""


@dataclass(frozen=True)
class MigSlice:
    """One MIG instance of a card (a GPU instance with its compute instance): what CUDA shows a
    process as one device, with its own memory."""

    index: int
    """Its MIG device index under the card (NVML's ``nvmlDeviceGetMigDeviceHandleByIndex``)."""
    uuid: str | None
    """``MIG-...``: what ``CUDA_VISIBLE_DEVICES`` names it by (``nvidia-smi -L`` lists it)."""
    name: str | None
    """As NVML names it: ``NVIDIA A100-SXM4-80GB MIG 3g.40gb`` (torch gives the same name)."""
    memory_bytes: int
    """Its own device memory, a share of the card's."""
    memory_free: int | None = None
    memory_used: int | None = None

    @property
    def profile(self) -> str:
        """The MIG profile from its name (``3g.40gb``), else ``slice N``."""
        name = self.name or ""
        return name.rpartition(" MIG ")[2] if " MIG " in name else f"slice {self.index}"


@dataclass(frozen=True)
class MigInfo:
    """A card's MIG (Multi-Instance GPU) mode, on cards that have one (A100, A30, H100, H200)."""

    enabled: bool
    """MIG is on now: CUDA sees the card only as its slices, one per process."""
    pending: bool
    """MIG will be on after the card's next reset (``nvidia-smi -mig`` takes effect then)."""
    slices: tuple[MigSlice, ...] = ()
    """The MIG instances that exist now (none unless ``enabled``)."""


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML reports it. Every field NVML may not support is optional (None)."""

    index: int
    name: str
    memory_total: int
    """Bytes of device memory."""
    uuid: str | None = None
    memory_free: int | None = None
    memory_used: int | None = None
    utilization_pct: int | None = None
    """GPU (SM) utilisation over NVML's last sample period, percent."""
    memory_utilization_pct: int | None = None
    temperature_c: int | None = None
    power_w: float | None = None
    power_limit_w: float | None = None
    energy_mj: int | None = None
    """Total energy counter since the driver loaded, millijoules (Volta and newer)."""
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_gen_max: int | None = None
    pcie_width_max: int | None = None
    pci_bus_id: str | None = None
    """PCI bus id as NVML writes it ("00000000:01:00.0"); NVML indices follow the bus order."""
    compute_capability: tuple[int, int] | None = None
    """CUDA compute capability (major, minor): (8, 6) for an RTX 3090, (7, 5) for an RTX 2080 Ti.
    bf16 needs 8.0 (Ampere) or newer; see `BF16_MIN_CAPABILITY`."""
    processes: tuple[GpuProcess, ...] | None = None
    """The compute and graphics processes holding memory on it, one per pid; None when NVML
    could not list them (not supported, no permission)."""
    mig: MigInfo | None = None
    """Its MIG mode and slices; None where the card has no MIG (NVML: not supported). With MIG
    on, ``memory_*`` are the whole card's, which no process can use: plans use one slice
    (`mig_slice`)."""


def mig_on(gpu: GpuInfo) -> bool:
    """CUDA sees ``gpu`` only as MIG slices (MIG is on now)."""
    return gpu.mig is not None and gpu.mig.enabled


def mig_off(index: int) -> str:
    """The commands that turn MIG off on the card with NVML index ``index`` (the whole card is
    then one CUDA device again), for hints."""
    return f"sudo nvidia-smi -i {index} -mig 0, then reset the card (sudo nvidia-smi -i {index} -r)"


def mig_slice(gpu: GpuInfo, wanted: str | None = None) -> MigSlice | None:
    """The slice a one-process run on ``gpu`` uses: the one whose MIG UUID is ``wanted`` (from
        ``CUDA_VISIBLE_DEVICES``), else the one with the most free memory (the lowest index among
        equals). Only a slice with a UUID can be named to CUDA, and only one whose memory NVML gave
    can be planned; None when there is none such."""
    named = [s for s in gpu.mig.slices if s.uuid and s.memory_bytes] if gpu.mig else []
    if wanted:
        named = [s for s in named if s.uuid == wanted] or named
    if not named:
        return None
    return max(named, key=lambda s: (s.memory_free or 0, -s.index))


@dataclass(frozen=True)
class GpuLink:
    """How two GPUs reach each other."""

    a: int
    b: int
    kind: Literal["nvlink", "p2p", "pcie", "unknown"]
    """nvlink: NVLink between the pair; p2p: PCIe peer-to-peer; pcie: through host memory."""
    nvlink_links: int = 0
    """Active NVLink links between the pair."""
    topology: str | None = None
    """Where the pair's PCIe paths meet, in words: "same board", "single PCIe switch",
    "multiple PCIe switches", "host bridge", "same CPU", "across CPUs"."""
    p2p: bool | None = None
    """PCIe peer-to-peer reads between the pair supported (None: NVML did not say)."""


@dataclass(frozen=True)
class HostInfo:
    """The CPU host: used when there is no GPU and for `cpu:N` plans."""

    cpu_model: str
    logical_cores: int
    physical_cores: int | None
    ram_total: int
    ram_available: int | None = None


@dataclass(frozen=True)
class HardwareReport:
    """Everything `homelab-dp probe` reports."""

    kind: DeviceKind
    host: HostInfo
    gpus: tuple[GpuInfo, ...] = ()
    links: tuple[GpuLink, ...] = ()
    driver_version: str | None = None
    cuda_driver_version: str | None = None
    notice: str | None = None
    """Why there are no GPUs (no driver, no device) and what to do about it, or a warning
    about a card that could not be read."""
    source: str | None = None
    """Where the GPU facts came from: "nvml", or "recording <file>" for recorded hardware."""
    visible_devices: str | None = None
    """CUDA_VISIBLE_DEVICES as the probe found it (None: unset). When set, `gpus` and `links`
    hold only the cards it leaves visible, each still numbered by its NVML index, and `notice`
    says what it hides (rules: `homelab_dp.probe.visible_gpus`)."""
    hidden_gpus: tuple[int, ...] = ()
    """NVML indices of the GPUs CUDA_VISIBLE_DEVICES hides: left out of `gpus` and of plans."""
    visible_mig: str | None = None
    """The MIG instance CUDA_VISIBLE_DEVICES names (its ``MIG-...`` UUID): plans use that slice
    of its card. None when it names none."""

    def to_json(self) -> dict:
        """A JSON-ready dict (the `probe --json` document)."""
        return asdict(self)


@dataclass(frozen=True)
class PlanDevice:
    """One device a plan budgets for."""

    name: str
    memory_bytes: int
    compute_capability: tuple[int, int] | None = None
    """(major, minor) from the probe or a what-if ``--gpus 2x11GiB@7.5``; None on the CPU and
    where it is not known (the planner then assumes bf16 works, and says so)."""
    free_bytes: int | None = None
    """A local card's free memory at probe time; None for what-if cards and the CPU, whose
    whole memory is budgeted."""
    processes: tuple[GpuProcess, ...] | None = None
    """What holds memory on a local card (None: not known, e.g. a what-if card)."""
    pcie_gen: int | None = None
    pcie_width: int | None = None
    """The PCIe link the card trains at (`trained_pcie_link`); None: not known (a what-if
    card, or NVML did not say), and an offloading plan then assumes one, saying so."""

    def budget(self, margin: float) -> int:
        """What a plan may use here: ``margin`` (the planner's safety margin) of the memory,
        and on a local card no more than its free memory less `free_margin`."""
        whole = int(margin * self.memory_bytes)
        if self.free_bytes is None:
            return whole
        return max(0, min(whole, self.free_bytes - free_margin(self.memory_bytes)))

    @property
    def held_bytes(self) -> int:
        """Memory in use by others at probe time (0 for a what-if card or the CPU)."""
        return 0 if self.free_bytes is None else max(0, self.memory_bytes - self.free_bytes)


@dataclass(frozen=True)
class PlanHardware:
    """The devices a plan is made for: one process (rank) per device."""

    kind: DeviceKind
    devices: tuple[PlanDevice, ...]
    source: str = "probe"
    """Where the devices came from: "probe", "--gpus <spec>", "preset"."""
    indices: tuple[int, ...] = field(default=())
    """The planned GPUs by NVML index (PCI bus order, as `homelab-dp probe` numbers them), one
    per device, when planned from the probe; empty otherwise."""
    uuids: tuple[str, ...] = field(default=())
    """The same GPUs by NVML UUID, one per index, when NVML gave every one (else empty): what
    the run puts in CUDA_VISIBLE_DEVICES, so the workers see exactly these cards. A MIG
    slice is named by its ``MIG-...`` UUID (the card's own UUID shows CUDA no device)."""
    notes: tuple[str, ...] = field(default=())
    """What choosing the devices decided that the plan should say (a MIG slice planned in
    place of its card); the plan's reasons start with these."""

    @property
    def world_size(self) -> int:
        return len(self.devices)

    @property
    def min_memory(self) -> int:
        """The smallest device's memory: mixed cards are limited by the smallest."""
        return min(d.memory_bytes for d in self.devices)

    def budget(self, margin: float) -> int:
        """What each device may use: the smallest `PlanDevice.budget` (every rank gets the
        same share)."""
        return min(d.budget(margin) for d in self.devices)

    def limited(self, margin: float) -> tuple[int, ...]:
        """Positions of the local cards whose budget is cut by what other processes hold."""
        return tuple(
            i for i, d in enumerate(self.devices) if d.budget(margin) < int(margin * d.memory_bytes)
        )

    def idle(self) -> PlanHardware:
        """The same devices with nothing else on them: every card budgeted whole."""
        devices = tuple(replace(d, free_bytes=None, processes=None) for d in self.devices)
        return replace(self, devices=devices)

    def below_capability(self, capability: tuple[int, int]) -> tuple[int, ...]:
        """Positions of the devices whose known compute capability is below ``capability``."""
        return tuple(
            i
            for i, d in enumerate(self.devices)
            if d.compute_capability is not None and d.compute_capability < capability
        )

    def unknown_capability(self) -> tuple[int, ...]:
        """Positions of the GPUs whose compute capability is not known (none on the CPU)."""
        if self.kind != "cuda":
            return ()
        return tuple(i for i, d in enumerate(self.devices) if d.compute_capability is None)

    def label(self, position: int) -> str:
        """A device for people: "GPU 1 (Tesla P40)" when planned from the probe, else its name."""
        name = self.devices[position].name
        if position < len(self.indices):
            return f"GPU {self.indices[position]} ({name})"
        return name


PCIE_GB_PER_S_PER_LANE = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
"""Usable GB/s per lane and direction after line coding (8b/10b to gen 2, 128b/130b to gen 5)."""


def trained_pcie_link(gpu: GpuInfo) -> tuple[int | None, int | None]:
    """(generation, width) of the link ``gpu`` trains at: NVML's maximum for the card in its
    slot when it gives one (an idle card drops its current link to save power), else the
    current link."""
    gen = gpu.pcie_gen_max or gpu.pcie_gen
    width = gpu.pcie_width_max or gpu.pcie_width
    return gen, width


def pcie_bytes_per_s(gen: int, width: int, efficiency: float = 1.0) -> float:
    """Bytes per second one way over a PCIe ``gen`` x``width`` link, times ``efficiency``."""
    per_lane = PCIE_GB_PER_S_PER_LANE.get(gen, PCIE_GB_PER_S_PER_LANE[6] if gen > 6 else 0.25)
    return per_lane * 1e9 * width * efficiency


def format_capability(capability: tuple[int, int] | None) -> str:
    """(8, 6) -> "8.6"; None -> "unknown"."""
    return "unknown" if capability is None else f"{capability[0]}.{capability[1]}"


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(gib|gb|g|mib|mb|m|tib|tb|t)?\s*$", re.IGNORECASE)
_UNIT = {
    None: GiB,
    "g": GiB,
    "gib": GiB,
    "gb": GiB,
    "m": MiB,
    "mib": MiB,
    "mb": MiB,
    "t": 1024 * GiB,
    "tib": 1024 * GiB,
    "tb": 1024 * GiB,
}
_GPUS_HINT = (
    "use e.g. --gpus 2x24GiB, --gpus 24GiB,12GiB, --gpus 4x80GiB, --gpus 2x11GiB@7.5 "
    "or --gpus cpu:2"
)


def parse_size(text: str) -> int:
    """Parse "24GiB", "24", "11.5G", "512MiB" into bytes (binary units; a bare number is GiB)."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(text)
    unit = m.group(2).lower() if m.group(2) else None
    value = float(m.group(1)) * _UNIT[unit]
    if value <= 0:
        raise ValueError(text)
    return int(value)


def format_bytes(n: float) -> str:
    """Human-readable binary size: 1.5 GiB, 300 MiB, 12 KiB."""
    for unit, size in (("TiB", 1024 * GiB), ("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if abs(n) < 10 * size else f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def parse_gpus_spec(spec: str, host_ram: int) -> PlanHardware:
    """Parse a what-if `--gpus` spec.

    ``2x24GiB`` two cards of 24 GiB; ``24GiB,12GiB`` a mixed pair; ``cpu:2`` two CPU processes
    sharing the host RAM (``host_ram`` bytes); ``cpu:2:64GiB`` the same with 64 GiB of RAM.

    A card's CUDA compute capability may follow its size after ``@``: ``2x11GiB@7.5`` two RTX
    2080 Ti, ``24GiB@8.6,24GiB@6.1`` an RTX 3090 beside a Tesla P40. It decides the dtype that
    ``model.dtype = "auto"`` gives (bf16 from 8.0, else fp16); without it the capability is
    unknown and bf16 is assumed.
    """
    text = spec.strip()
    if not text:
        raise HardwareSpecError("--gpus: empty spec", _GPUS_HINT)
    if text.lower().startswith("cpu"):
        m = re.match(r"^cpu(?::(\d+))?(?::(.+))?$", text, re.IGNORECASE)
        if not m:
            raise HardwareSpecError(f"--gpus: cannot read {spec!r}", _GPUS_HINT)
        nproc = int(m.group(1) or 1)
        if nproc < 1:
            raise HardwareSpecError(f"--gpus: {spec!r} asks for {nproc} processes", _GPUS_HINT)
        ram = host_ram
        if m.group(2):
            try:
                ram = parse_size(m.group(2))
            except ValueError:
                raise HardwareSpecError(
                    f"--gpus: cannot read the RAM size {m.group(2)!r} in {spec!r}", _GPUS_HINT
                ) from None
        per_proc = ram // nproc
        devices = tuple(PlanDevice(f"cpu process {i}", per_proc) for i in range(nproc))
        return PlanHardware("cpu", devices, source=f"--gpus {spec}")
    devices: list[PlanDevice] = []
    for part in text.split(","):
        part = part.strip()
        m = re.match(r"^(?:(\d+)\s*[x×*]\s*)?(.+)$", part, re.IGNORECASE)
        if not m or not part:
            raise HardwareSpecError(f"--gpus: cannot read {part!r} in {spec!r}", _GPUS_HINT)
        count = int(m.group(1)) if m.group(1) else 1
        size_text, at, cc_text = m.group(2).partition("@")
        capability = None
        if at:
            cc = re.match(r"^\s*(\d+)\.(\d+)\s*$", cc_text)
            if not cc or int(cc.group(1)) < 1:
                raise HardwareSpecError(
                    f"--gpus: cannot read the compute capability {cc_text!r} in {spec!r} "
                    "(major.minor, e.g. 8.6)",
                    _GPUS_HINT,
                )
            capability = (int(cc.group(1)), int(cc.group(2)))
        try:
            size = parse_size(size_text)
        except ValueError:
            raise HardwareSpecError(
                f"--gpus: cannot read the memory size {size_text!r} in {spec!r}", _GPUS_HINT
            ) from None
        if count < 1 or count > 64:
            raise HardwareSpecError(
                f"--gpus: {count} cards in {spec!r} is out of range (1 to 64)", _GPUS_HINT
            )
        name = f"what-if {format_bytes(size)}"
        devices.extend(PlanDevice(name, size, capability) for _ in range(count))
    return PlanHardware("cuda", tuple(devices), source=f"--gpus {spec}")
