"""What a plan is made for: the devices it budgets, one process (rank) each, and the
``--gpus`` what-if that names devices this machine does not have.

`homelab_dp.app.plan` builds a `PlanHardware` from the probe (`homelab_dp.probe.hardware`,
what the machine has) or from `parse_gpus_spec`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

from homelab_dp.byte_units import MiB, format_bytes, parse_size
from homelab_dp.errors import HardwareSpecError
from homelab_dp.probe.hardware import DeviceKind, GpuProcess

FREE_MARGIN_MIN = 256 * MiB
FREE_MARGIN_SHARE = 0.02
"""A local card's budget keeps this much of its free memory back (the larger of the two):
other processes' memory moves between the probe and the run's peak."""


def free_margin(total: int) -> int:
    """What a plan leaves of a local card's free memory: max(256 MiB, 2% of the card)."""
    return max(FREE_MARGIN_MIN, int(FREE_MARGIN_SHARE * total))


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
    """The PCIe link the card trains at (`probe.hardware.trained_pcie_link`); None: not known (a what-if
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


GPUS_HINT = (
    "use e.g. --gpus 2x24GiB, --gpus 24GiB,12GiB, --gpus 4x80GiB, --gpus 2x11GiB@7.5 "
    "or --gpus cpu:2"
)
"""What a refused ``--gpus`` spec is told to look like."""


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
        raise HardwareSpecError("--gpus: empty spec", GPUS_HINT)
    if text.lower().startswith("cpu"):
        m = re.match(r"^cpu(?::(\d+))?(?::(.+))?$", text, re.IGNORECASE)
        if not m:
            raise HardwareSpecError(f"--gpus: cannot read {spec!r}", GPUS_HINT)
        nproc = int(m.group(1) or 1)
        if nproc < 1:
            raise HardwareSpecError(f"--gpus: {spec!r} asks for {nproc} processes", GPUS_HINT)
        ram = host_ram
        if m.group(2):
            try:
                ram = parse_size(m.group(2))
            except ValueError:
                raise HardwareSpecError(
                    f"--gpus: cannot read the RAM size {m.group(2)!r} in {spec!r}", GPUS_HINT
                ) from None
        per_proc = ram // nproc
        devices = tuple(PlanDevice(f"cpu process {i}", per_proc) for i in range(nproc))
        return PlanHardware("cpu", devices, source=f"--gpus {spec}")
    devices: list[PlanDevice] = []
    for part in text.split(","):
        part = part.strip()
        m = re.match(r"^(?:(\d+)\s*[x×*]\s*)?(.+)$", part, re.IGNORECASE)
        if not m or not part:
            raise HardwareSpecError(f"--gpus: cannot read {part!r} in {spec!r}", GPUS_HINT)
        count = int(m.group(1)) if m.group(1) else 1
        size_text, at, cc_text = m.group(2).partition("@")
        capability = None
        if at:
            cc = re.match(r"^\s*(\d+)\.(\d+)\s*$", cc_text)
            if not cc or int(cc.group(1)) < 1:
                raise HardwareSpecError(
                    f"--gpus: cannot read the compute capability {cc_text!r} in {spec!r} "
                    "(major.minor, e.g. 8.6)",
                    GPUS_HINT,
                )
            capability = (int(cc.group(1)), int(cc.group(2)))
        try:
            size = parse_size(size_text)
        except ValueError:
            raise HardwareSpecError(
                f"--gpus: cannot read the memory size {size_text!r} in {spec!r}", GPUS_HINT
            ) from None
        if count < 1 or count > 64:
            raise HardwareSpecError(
                f"--gpus: {count} cards in {spec!r} is out of range (1 to 64)", GPUS_HINT
            )
        name = f"what-if {format_bytes(size)}"
        devices.extend(PlanDevice(name, size, capability) for _ in range(count))
    return PlanHardware("cuda", tuple(devices), source=f"--gpus {spec}")
