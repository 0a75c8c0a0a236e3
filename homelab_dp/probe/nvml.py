"""The NVML gateway: the only module that talks to pynvml (package nvidia-ml-py).

Every NVML query is guarded: "not supported", "no permission", a lost GPU or a function the
driver lacks becomes None for that one field, never a crash (the approach of nvitop). The
processes holding memory on each card are `homelab_dp.probe.gpu_processes`. No driver,
no pynvml or no GPU gives a CPU-host report with a notice that says why and what to do.

pynvml is imported lazily, inside functions, so that importing this module stays cheap. When the
environment variable ``HOMELAB_DP_FAKE_NVML`` names a recording (see `homelab_dp.probe.fake_nvml`),
`probe()`, `sample()` and `host_info()` answer from it: that is how CLI and TUI tests and demos run
against recorded hardware.
"""

from __future__ import annotations

import os
from types import TracebackType
from typing import Any

from homelab_dp.probe.cpu_host import host_info
from homelab_dp.probe.fake_nvml import FAKE_ENV, load_recording
from homelab_dp.probe.gpu_processes import running_processes
from homelab_dp.probe.hardware import GpuInfo, GpuLink, HardwareReport, MigInfo, MigSlice
from homelab_dp.probe.visible_gpus import VISIBLE_ENV, visibility

__all__ = ["FAKE_ENV", "NvmlSession", "host_info", "probe", "sample"]

# NVML C enum values, fixed by the C API. Spelled out here because pynvml declares
# NVML_P2P_CAPS_INDEX_READ as the tuple (0,) (a stray comma), which ctypes refuses.
_P2P_CAPS_READ = 0
_P2P_CAPS_NVLINK = 2
_P2P_STATUS_OK = 0
_TEMPERATURE_GPU = 0
_ERROR_DRIVER_NOT_LOADED = 9
_ERROR_LIBRARY_NOT_FOUND = 12
_MIG_ENABLE = 1  # NVML_DEVICE_MIG_ENABLE: CUDA sees the card as its MIG instances
_NVLINK_MAX_LINKS = 18  # fallback when the module does not say (NVML 13 allows up to 36)

_TOPOLOGY_WORDS = {
    0: "same board",
    10: "single PCIe switch",
    20: "multiple PCIe switches",
    30: "host bridge",
    40: "same CPU",
    50: "across CPUs",
}

_WHAT_IF = "or plan for cards you don't have with --gpus 2x24GiB."


def _query(nvml: Any, name: str, *args: Any) -> Any:
    """``nvml.<name>(*args)``, or None when NVML cannot answer.

    Any NVMLError (not supported, no permission, GPU lost, function not found in this driver)
    means "unknown" for this one field. A function missing from an old nvidia-ml-py is the same.
    """
    fn = getattr(nvml, name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _text(value: Any) -> str | None:
    """NVML strings come back as str from pynvml's wrappers but as bytes inside structs."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\x00")
    return str(value)


def mig_info(nvml: Any, handle: Any) -> MigInfo | None:
    """A card's MIG (Multi-Instance GPU) mode (``nvmlDeviceGetMigMode``: current, pending) and,
    when it is on, its MIG instances (``nvmlDeviceGetMigDeviceHandleByIndex`` up to
    ``nvmlDeviceGetMaxMigDeviceCount``); None for a card without MIG. With MIG on (A100, A30,
    H100, H200) CUDA sees the card only as its instances, each a device with its own memory and
    a ``MIG-...`` UUID. An index that holds no
    instance is skipped; a slice whose memory NVML does not give is listed with 0 bytes."""
    try:
        current, pending = _query(nvml, "nvmlDeviceGetMigMode", handle)
    except (TypeError, ValueError):  # None (not supported) or an answer of another shape
        return None
    enabled = current == _MIG_ENABLE
    count = _query(nvml, "nvmlDeviceGetMaxMigDeviceCount", handle) if enabled else 0
    slices = []
    for index in range(count if isinstance(count, int) else 0):
        mig = _query(nvml, "nvmlDeviceGetMigDeviceHandleByIndex", handle, index)
        if mig is None:
            continue
        memory = _query(nvml, "nvmlDeviceGetMemoryInfo", mig)
        slices.append(
            MigSlice(
                index=index,
                uuid=_text(_query(nvml, "nvmlDeviceGetUUID", mig)),
                name=_text(_query(nvml, "nvmlDeviceGetName", mig)),
                memory_bytes=getattr(memory, "total", None) or 0,
                memory_free=getattr(memory, "free", None),
                memory_used=getattr(memory, "used", None),
            )
        )
    return MigInfo(enabled, pending == _MIG_ENABLE, tuple(slices))


def _attr(obj: Any, name: str) -> Any:
    return None if obj is None else getattr(obj, name, None)


def _watts(milliwatts: Any) -> float | None:
    return None if milliwatts is None else round(milliwatts / 1000, 3)


def _capability(value: Any) -> tuple[int, int] | None:
    """pynvml gives the compute capability as a (major, minor) pair; anything else is unknown."""
    try:
        major, minor = value
    except (TypeError, ValueError):
        return None
    if not isinstance(major, int) or not isinstance(minor, int) or major <= 0 or minor < 0:
        return None
    return (major, minor)


def _cuda_version(value: Any) -> str | None:
    """NVML encodes CUDA 12.4 as 12040."""
    if not isinstance(value, int) or value <= 0:
        return None
    return f"{value // 1000}.{value % 1000 // 10}"


def _bus_key(bus_id: Any) -> tuple[int, ...] | str | None:
    """Compare PCI bus ids by value: NVML pads the domain to 4 or 8 digits depending on the call."""
    text = _text(bus_id)
    if not text:
        return None
    try:
        domain, bus, rest = text.strip().split(":")
        device, function = rest.split(".")
        return tuple(int(part, 16) for part in (domain, bus, device, function))
    except ValueError:
        return text.strip().lower()


def _load_module(nvml: Any) -> tuple[Any, str | None]:
    """The NVML module to use: the one given, a recording named by the env var, or pynvml."""
    if nvml is not None:
        return nvml, None
    recording = os.environ.get(FAKE_ENV)
    if recording:
        return load_recording(recording), None
    try:
        import pynvml
    except ImportError:
        return None, (
            "nvidia-ml-py (pynvml) is not installed, so the GPUs cannot be probed; planning for "
            f"the CPU host. Install it with `pip install nvidia-ml-py`, {_WHAT_IF}"
        )
    return pynvml, None


def _init_notice(err: Exception) -> str:
    code = getattr(err, "value", None)
    if code == _ERROR_LIBRARY_NOT_FOUND:
        return (
            "No NVIDIA driver found (NVML library not found); planning for the CPU host. "
            f"Install the NVIDIA driver, {_WHAT_IF}"
        )
    if code == _ERROR_DRIVER_NOT_LOADED:
        return (
            "The NVIDIA driver is installed but not loaded (NVML: driver not loaded); planning "
            "for the CPU host. Reboot after installing the driver or run `sudo modprobe nvidia`, "
            f"{_WHAT_IF}"
        )
    return (
        f"NVML could not start ({err}); planning for the CPU host. Check that `nvidia-smi` "
        f"works, {_WHAT_IF}"
    )


class NvmlSession:
    """One NVML session: initialise once, query many times, shut down once.

    Use it as a context manager. The device monitor keeps one open and calls `sample()` every
    interval, which costs a few NVML calls per GPU instead of an init/shutdown each time.
    """

    def __init__(self, nvml: Any = None) -> None:
        self._requested = nvml
        self.nvml: Any = None
        self.notice: str | None = None
        """Why no GPU can be queried (set by `open`), with what to do about it."""
        self.device_count = 0
        self._initialised = False
        self._handles: dict[int, Any] = {}

    def __enter__(self) -> NvmlSession:
        self.open()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def available(self) -> bool:
        """NVML is initialised and reports at least one GPU."""
        return self._initialised and self.device_count > 0

    @property
    def source(self) -> str:
        """Where the answers come from: "nvml", or "recording <file>" for recorded hardware."""
        return getattr(self.nvml, "recording_source", None) or "nvml"

    def open(self) -> bool:
        """Initialise NVML and count the GPUs; False (and `notice` set) when there are none."""
        if self._initialised:
            return self.available
        self.nvml, self.notice = _load_module(self._requested)
        if self.nvml is None:
            return False
        try:
            self.nvml.nvmlInit()
        except self.nvml.NVMLError as err:
            self.notice = _init_notice(err)
            return False
        self._initialised = True
        count = _query(self.nvml, "nvmlDeviceGetCount")
        self.device_count = count or 0
        if count is None:
            self.notice = (
                "The NVIDIA driver is loaded but NVML could not count the GPUs; planning for the "
                f"CPU host. Check that `nvidia-smi` works, {_WHAT_IF}"
            )
        elif count == 0:
            self.notice = (
                "The NVIDIA driver is loaded but reports no GPU; planning for the CPU host. "
                f"Check that the card is seated and powered, {_WHAT_IF}"
            )
        return self.available

    def close(self) -> None:
        """Shut NVML down (once; safe to call again)."""
        if not self._initialised:
            return
        self._initialised = False
        self._handles.clear()
        _query(self.nvml, "nvmlShutdown")  # a failed shutdown leaves nothing to release

    def handle(self, index: int) -> Any:
        """The device handle for NVML index `index`, or None if the GPU cannot be opened."""
        if index not in self._handles:
            found = _query(self.nvml, "nvmlDeviceGetHandleByIndex", index)
            if found is None:
                return None  # not cached: a GPU that is busy resetting may answer next time
            self._handles[index] = found
        return self._handles[index]

    def _device_query(self, name: str, handle: Any, *args: Any) -> Any:
        """A guarded per-device query; None for a GPU that could not be opened."""
        return None if handle is None else _query(self.nvml, name, handle, *args)

    def gpu(self, index: int) -> GpuInfo | None:
        """Everything NVML says about one GPU, or None if it cannot be opened."""
        handle = self.handle(index)
        if handle is None:
            return None
        nvml = self.nvml
        memory = _query(nvml, "nvmlDeviceGetMemoryInfo", handle)
        util = _query(nvml, "nvmlDeviceGetUtilizationRates", handle)
        return GpuInfo(
            index=index,
            name=_text(_query(nvml, "nvmlDeviceGetName", handle)) or f"GPU {index}",
            memory_total=_attr(memory, "total") or 0,
            uuid=_text(_query(nvml, "nvmlDeviceGetUUID", handle)),
            memory_free=_attr(memory, "free"),
            memory_used=_attr(memory, "used"),
            utilization_pct=_attr(util, "gpu"),
            memory_utilization_pct=_attr(util, "memory"),
            temperature_c=_query(nvml, "nvmlDeviceGetTemperature", handle, _TEMPERATURE_GPU),
            power_w=_watts(_query(nvml, "nvmlDeviceGetPowerUsage", handle)),
            power_limit_w=_watts(_query(nvml, "nvmlDeviceGetEnforcedPowerLimit", handle)),
            energy_mj=_query(nvml, "nvmlDeviceGetTotalEnergyConsumption", handle),
            pcie_gen=_query(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle),
            pcie_width=_query(nvml, "nvmlDeviceGetCurrPcieLinkWidth", handle),
            pcie_gen_max=_query(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", handle),
            pcie_width_max=_query(nvml, "nvmlDeviceGetMaxPcieLinkWidth", handle),
            pci_bus_id=_text(_attr(_query(nvml, "nvmlDeviceGetPciInfo", handle), "busId")),
            compute_capability=_capability(
                _query(nvml, "nvmlDeviceGetCudaComputeCapability", handle)
            ),
            processes=running_processes(nvml, handle),
            mig=mig_info(nvml, handle),
        )

    def _nvlink_counts(self, gpus: list[GpuInfo]) -> dict[tuple[int, int], int]:
        """Active NVLink links from each GPU to each other GPU, keyed (from, to)."""
        nvml = self.nvml
        by_bus = {_bus_key(g.pci_bus_id): g.index for g in gpus if g.pci_bus_id}
        max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", _NVLINK_MAX_LINKS)
        counts: dict[tuple[int, int], int] = {}
        for gpu in gpus:
            handle = self.handle(gpu.index)
            for link in range(max_links):
                try:
                    active = nvml.nvmlDeviceGetNvLinkState(handle, link)
                except nvml.NVMLError:
                    # Not supported on link 0: no NVLink at all. Invalid argument: past the
                    # card's last link. Either way there is nothing more to find on this card.
                    break
                if not active:
                    continue
                remote = _query(nvml, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
                peer = by_bus.get(_bus_key(_attr(remote, "busId")))
                # A peer that is not a GPU here (an NVSwitch, a bridge) is counted via P2P status
                if peer is not None and peer != gpu.index:
                    counts[(gpu.index, peer)] = counts.get((gpu.index, peer), 0) + 1
        return counts

    def links(self, gpus: list[GpuInfo]) -> tuple[GpuLink, ...]:
        """How each pair of `gpus` reaches the other: NVLink, PCIe peer-to-peer, or via the host."""
        nvml = self.nvml
        nvlink_counts = self._nvlink_counts(gpus) if len(gpus) > 1 else {}
        links = []
        for i, first in enumerate(gpus):
            for second in gpus[i + 1 :]:
                a, b = first.index, second.index
                ha, hb = self.handle(a), self.handle(b)
                # Each side counts its own links; a bridge seen from one side only still counts
                count = max(nvlink_counts.get((a, b), 0), nvlink_counts.get((b, a), 0))
                nvlink_status = _query(nvml, "nvmlDeviceGetP2PStatus", ha, hb, _P2P_CAPS_NVLINK)
                read_status = _query(nvml, "nvmlDeviceGetP2PStatus", ha, hb, _P2P_CAPS_READ)
                level = _query(nvml, "nvmlDeviceGetTopologyCommonAncestor", ha, hb)
                p2p = None if read_status is None else read_status == _P2P_STATUS_OK
                if count or nvlink_status == _P2P_STATUS_OK:
                    kind = "nvlink"
                elif p2p is not None:
                    kind = "p2p" if p2p else "pcie"
                else:
                    kind = "unknown"
                topology = None if level is None else _TOPOLOGY_WORDS.get(level, f"level {level}")
                links.append(GpuLink(a, b, kind, count, topology, p2p))
        return tuple(links)

    def report(self) -> HardwareReport:
        """The whole probe: driver, every GPU, every pair of GPUs; the CPU host when no GPU.

        Only the GPUs that ``CUDA_VISIBLE_DEVICES`` leaves visible are reported, with their
        NVML indices (`homelab_dp.probe.visible_gpus`); the rest are listed in ``hidden_gpus``.
        """
        found = self.open()
        host = host_info(self.nvml)
        visible_value = os.environ.get(VISIBLE_ENV)
        if not found:
            return HardwareReport(
                kind="cpu",
                host=host,
                notice=self.notice,
                source=self.source,
                visible_devices=visible_value,
            )
        opened = {index: self.gpu(index) for index in range(self.device_count)}
        seen = visibility(
            os.environ,
            self.device_count,
            {i: g.uuid for i, g in opened.items() if g is not None},
            {i: g.name for i, g in opened.items() if g is not None},
            {
                i: tuple(s.uuid for s in g.mig.slices if s.uuid)
                for i, g in opened.items()
                if g is not None and g.mig
            },
        )
        gpus: list[GpuInfo] = []
        warnings: list[str] = []
        for index, gpu in opened.items():
            if not seen.visible(index):
                continue
            if gpu is None:
                warnings.append(f"GPU {index} could not be opened through NVML and is left out")
                continue
            gpus.append(gpu)
            if not gpu.memory_total:
                warnings.append(f"GPU {index} ({gpu.name}) did not report its memory size")
        hidden = tuple(i for i in opened if not seen.visible(i))
        if not gpus:
            if any(opened.values()) and seen.notice:  # every card that answers is hidden
                notice = (
                    f"{seen.notice}; planning for the CPU host. Unset {VISIBLE_ENV} or name the "
                    f"cards to use in it, {_WHAT_IF}"
                )
            else:
                notice = (
                    "NVML lists GPUs but none could be opened; planning for the CPU host. Check "
                    f"`nvidia-smi` and your permissions on /dev/nvidia*, {_WHAT_IF}"
                )
            return HardwareReport(
                kind="cpu",
                host=host,
                notice=notice,
                source=self.source,
                visible_devices=visible_value,
                hidden_gpus=hidden,
            )
        notes = [
            "; ".join(warnings) + "." if warnings else "",
            f"{seen.notice}." if seen.notice else "",
        ]
        return HardwareReport(
            kind="cuda",
            host=host,
            gpus=tuple(gpus),
            links=self.links(gpus),
            driver_version=_text(_query(self.nvml, "nvmlSystemGetDriverVersion")),
            cuda_driver_version=_cuda_version(_query(self.nvml, "nvmlSystemGetCudaDriverVersion")),
            notice=" ".join(n for n in notes if n) or None,
            source=self.source,
            visible_devices=visible_value,
            hidden_gpus=hidden,
            visible_mig=seen.mig_uuid,
        )

    def sample(self, indices: list[int] | None = None) -> list[dict[str, Any]]:
        """A cheap reading per GPU (all GPUs, or `indices`); [] when there is no GPU.

        Keys: index, utilization_pct, memory_utilization_pct, memory_used, memory_total,
        temperature_c, power_w, energy_mj (names as in `GpuInfo`); None where NVML cannot say.
        """
        if not self.open():
            return []
        readings = []
        for index in range(self.device_count) if indices is None else indices:
            handle = self.handle(index)
            memory = self._device_query("nvmlDeviceGetMemoryInfo", handle)
            util = self._device_query("nvmlDeviceGetUtilizationRates", handle)
            power = self._device_query("nvmlDeviceGetPowerUsage", handle)
            readings.append(
                {
                    "index": index,
                    "utilization_pct": _attr(util, "gpu"),
                    "memory_utilization_pct": _attr(util, "memory"),
                    "memory_used": _attr(memory, "used"),
                    "memory_total": _attr(memory, "total"),
                    "temperature_c": self._device_query(
                        "nvmlDeviceGetTemperature", handle, _TEMPERATURE_GPU
                    ),
                    "power_w": _watts(power),
                    "energy_mj": self._device_query("nvmlDeviceGetTotalEnergyConsumption", handle),
                }
            )
        return readings


def probe(nvml: Any = None) -> HardwareReport:
    """Probe the GPUs through NVML (or `nvml`, a module-like stand-in such as `FakeNvml`).

    Never raises for missing hardware: no driver, no pynvml or no GPU gives ``kind="cpu"`` with
    the CPU host and a `notice`. Raises `HomelabError` only for an unreadable recording named by
    ``HOMELAB_DP_FAKE_NVML``.
    """
    with NvmlSession(nvml) as session:
        return session.report()


def sample(nvml: Any = None, indices: list[int] | None = None) -> list[dict[str, Any]]:
    """One reading per GPU (see `NvmlSession.sample`); opens and closes NVML around it."""
    with NvmlSession(nvml) as session:
        return session.sample(indices)
