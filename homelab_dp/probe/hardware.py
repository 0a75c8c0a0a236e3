"""What the machine has, as the probe reports it: its cards (memory, capability, MIG slices,
the processes on them), their links and the host.

Pure data; the probing itself lives in `homelab_dp.probe.nvml` and `homelab_dp.probe.cpu_host`.
What a plan is made for is `homelab_dp.planning.plan_hardware`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

BF16_MIN_CAPABILITY = (8, 0)
"""The oldest compute capability with bf16 arithmetic (Ampere); older cards compute in fp16."""

DeviceKind = Literal["cuda", "cpu"]


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
