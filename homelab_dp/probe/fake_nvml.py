"""A stand-in for pynvml that answers from recorded hardware (a JSON document).

It stands in only at the hardware boundary: `homelab_dp.probe.nvml` calls it exactly as it calls
pynvml, and it raises pynvml's own exception classes, so the probe's real error handling runs.

Recording format (see ``tests/data/nvml/*.json``)::

    {
      "comment": "free text",
      "error": "LibraryNotFound",            # optional: nvmlInit raises this NVML error
      "host": {"cpu_model": ..., "logical_cores": ..., "physical_cores": ...,
               "ram_total": ..., "ram_available": ...},
      "driver_version": "550.107.02",
      "cuda_driver_version": 12040,          # as NVML gives it: 1000 * major + 10 * minor
      "devices": [{
        "name": ..., "uuid": ..., "pci_bus_id": "00000000:01:00.0",
        "compute_capability": [8, 6],        # (major, minor), as pynvml returns it
        "memory": {"total": bytes, "free": bytes, "used": bytes},
        "utilization": {"gpu": pct, "memory": pct},
        "temperature": celsius,
        "power_usage_mw": ..., "power_limit_mw": ..., "energy_mj": ...,
        "pcie": {"gen": 4, "width": 16, "gen_max": 4, "width_max": 16},
        "nvlink": [{"active": true, "remote_bus_id": "00000000:4A:00.0"}, ...],
        "compute_processes": [{"pid": 4242, "name": "python3", "used_bytes": 6442450944}],
        "graphics_processes": [{"pid": 2101, "name": "Xorg", "used_bytes": null}],
        "mig_mode": [1, 1],                  # (current, pending): 1 on, 0 off
        "max_mig_device_count": 7,
        "mig_devices": [{"name": "NVIDIA A100-SXM4-80GB MIG 3g.40gb", "uuid": "MIG-...",
                         "memory": {"total": bytes, "free": bytes, "used": bytes}}]
      }],
      "pairs": {"0-1": {"p2p_read": "OK", "p2p_nvlink": "OK", "topology": "NODE"}}
    }

Any value may be the string ``"NOT_SUPPORTED"`` (the call raises ``NVMLError_NotSupported``) or
``"ERROR:<NAME>"`` (raises the NVML error ``NVML_ERROR_<NAME>``, e.g. ``"ERROR:GPU_IS_LOST"``); a
missing key also answers "not supported", as a card that does not know the query would. A device's
``"handle"`` key set to an error makes ``nvmlDeviceGetHandleByIndex`` fail for it. P2P answers are
names of ``NVML_P2P_STATUS_*`` (``"OK"``, ``"CHIPSET_NOT_SUPPORTED"``, ``"GPU_NOT_SUPPORTED"`` …)
or integers; topology answers are names of ``NVML_TOPOLOGY_*`` (``"HOSTBRIDGE"``, ``"NODE"`` …).

MIG: ``mig_devices`` lists the MIG instances by MIG device index (``null`` or a missing index up
to ``max_mig_device_count`` answers ``NVML_ERROR_NOT_FOUND``, as a free index does); a MIG
handle answers ``nvmlDeviceGetName``, ``nvmlDeviceGetUUID`` and ``nvmlDeviceGetMemoryInfo`` from
its entry and "not supported" to everything else. A card without ``mig_mode`` has no MIG.

Processes: ``used_bytes`` null is NVML's "not available"; ``name`` is what the probe reports for
the pid (the test machine's /proc is not asked). A recording without the process keys (made before
they existed) answers "not supported": no processes known, the recorded free memory stands.
``"VERSION_MISMATCH"`` makes a call raise pynvml's ``NVMLLibraryMismatchError`` (an nvidia-ml-py
newer than the driver); ``compute_processes_v2`` / ``graphics_processes_v2`` then answer the
``_v2`` calls.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from homelab_dp.errors import HomelabError
from homelab_dp.probe.hardware import HostInfo

_MIG_KEYS = ("name", "uuid", "memory")
"""What a MIG handle answers from its recorded entry."""

FAKE_ENV = "HOMELAB_DP_FAKE_NVML"
"""Names a recording JSON file; `probe()` and `sample()` then answer from it instead of NVML."""

_RECORDING_HINT = (
    f"{FAKE_ENV} must name a JSON recording such as tests/data/nvml/2x3090-nvlink.json; "
    f"unset it to probe the real GPUs"
)


class _Handle:
    """A device handle: only the fake itself looks inside."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __repr__(self) -> str:
        return f"<fake NVML device {self.index}>"


class _MigHandle:
    """A MIG device handle: the card's handle and the MIG device index under it."""

    def __init__(self, parent: _Handle, index: int) -> None:
        self.parent = parent
        self.index = index

    def __repr__(self) -> str:
        return f"<fake NVML MIG device {self.parent.index}/{self.index}>"


class FakeNvml:
    """pynvml's functions, answered from `recording`. Counts init/shutdown and logs calls."""

    def __init__(self, recording: dict[str, Any], source: str = "recording") -> None:
        import pynvml  # real exception classes and error codes, so the probe's handling is real

        self._pynvml = pynvml
        self.NVMLError = pynvml.NVMLError
        self.NVMLError_NotSupported = pynvml.NVMLError_NotSupported
        self.NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
        self.NVMLError_DriverNotLoaded = pynvml.NVMLError_DriverNotLoaded
        # Not an NVMLError: raised by nvidia-ml-py itself for a call the driver is too old for
        self.NVMLLibraryMismatchError = pynvml.NVMLLibraryMismatchError
        self.recording = recording
        self.recording_source = source
        self.recorded_host = _host(recording.get("host"), source)
        self.devices: list[dict[str, Any]] = list(recording.get("devices", []))
        self.init_count = 0
        self.shutdown_count = 0
        self.calls: list[str] = []

    # -- answering ---------------------------------------------------------------------------
    def _error(self, name: str) -> Exception:
        code = getattr(self._pynvml, f"NVML_ERROR_{name}", None)
        if code is None:
            raise ValueError(f"{self.recording_source}: unknown NVML error {name!r}")
        return self.NVMLError(code)

    def _answer(self, value: Any) -> Any:
        if value == "VERSION_MISMATCH":
            raise self.NVMLLibraryMismatchError(f"{self.recording_source}: recorded")
        if value == "NOT_SUPPORTED":
            raise self._error("NOT_SUPPORTED")
        if isinstance(value, str) and value.startswith("ERROR:"):
            raise self._error(value.removeprefix("ERROR:"))
        return value

    def _enter(self, name: str) -> None:
        self.calls.append(name)
        if self.init_count <= self.shutdown_count:
            raise self._error("UNINITIALIZED")  # as real NVML does outside init/shutdown

    def _device(self, name: str, handle: Any) -> dict[str, Any]:
        self._enter(name)
        if not isinstance(handle, _Handle):
            raise self._error("INVALID_ARGUMENT")
        return self.devices[handle.index]

    def _field(self, name: str, handle: Any, key: str) -> Any:
        if isinstance(handle, _MigHandle):  # a MIG instance knows its name, UUID and memory
            self._enter(name)
            entry = self._mig_entry(handle.parent, handle.index)
            known = entry.get(key, "NOT_SUPPORTED") if key in _MIG_KEYS else "NOT_SUPPORTED"
            return self._answer(known)
        return self._answer(self._device(name, handle).get(key, "NOT_SUPPORTED"))

    def _mig_entry(self, parent: _Handle, index: int) -> dict[str, Any]:
        listed = self._answer(self.devices[parent.index].get("mig_devices", "NOT_SUPPORTED"))
        entry = listed[index] if 0 <= index < len(listed) else None
        if entry is None:
            raise self._error("NOT_FOUND")
        return entry

    def _sub(self, name: str, handle: Any, key: str, sub: str) -> Any:
        return self._answer(self._field(name, handle, key).get(sub, "NOT_SUPPORTED"))

    def _pair(self, name: str, h1: Any, h2: Any, key: str) -> Any:
        self._device(name, h1)
        self._device(name, h2)
        a, b = sorted((h1.index, h2.index))
        pair = self.recording.get("pairs", {}).get(f"{a}-{b}", {})
        return self._answer(pair.get(key, "NOT_SUPPORTED"))

    def _enum(self, prefix: str, value: Any) -> int:
        if isinstance(value, int):
            return value
        code = getattr(self._pynvml, f"{prefix}{value}", None)
        if not isinstance(code, int):
            raise ValueError(f"{self.recording_source}: unknown {prefix}* value {value!r}")
        return code

    # -- the pynvml functions the probe uses ----------------------------------------------------
    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        error = self.recording.get("error")
        if error:
            # "LibraryNotFound", "DriverNotLoaded" or "LIBRARY_NOT_FOUND" all name the same code
            wanted = str(error).replace("_", "").lower()
            for attr in dir(self._pynvml):
                if attr.startswith("NVML_ERROR_") and attr[11:].replace("_", "").lower() == wanted:
                    raise self._error(attr[11:])
            raise ValueError(f"{self.recording_source}: unknown NVML error {error!r}")
        self.init_count += 1

    def nvmlShutdown(self) -> None:
        self._enter("nvmlShutdown")
        self.shutdown_count += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        return self._answer(self.recording.get("driver_version", "NOT_SUPPORTED"))

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._enter("nvmlSystemGetCudaDriverVersion")
        return self._answer(self.recording.get("cuda_driver_version", "NOT_SUPPORTED"))

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.devices):
            raise self._error("INVALID_ARGUMENT")
        self._answer(self.devices[index].get("handle"))
        return _Handle(index)

    def nvmlDeviceGetName(self, handle: Any) -> str:
        return self._field("nvmlDeviceGetName", handle, "name")

    def nvmlDeviceGetUUID(self, handle: Any) -> str:
        return self._field("nvmlDeviceGetUUID", handle, "uuid")

    def nvmlDeviceGetPciInfo(self, handle: Any) -> SimpleNamespace:
        # Real NVML gives bytes here (a ctypes char array), so the probe must decode
        bus_id = self._field("nvmlDeviceGetPciInfo", handle, "pci_bus_id")
        return SimpleNamespace(busId=bus_id.encode())

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any) -> tuple[int, int]:
        major, minor = self._field(
            "nvmlDeviceGetCudaComputeCapability", handle, "compute_capability"
        )
        return (major, minor)  # pynvml returns a tuple; JSON can only hold a list

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: Any = None) -> SimpleNamespace:
        memory = self._field("nvmlDeviceGetMemoryInfo", handle, "memory")
        return SimpleNamespace(total=memory["total"], free=memory["free"], used=memory["used"])

    def nvmlDeviceGetUtilizationRates(self, handle: Any) -> SimpleNamespace:
        util = self._field("nvmlDeviceGetUtilizationRates", handle, "utilization")
        return SimpleNamespace(gpu=util["gpu"], memory=util["memory"])

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: int) -> int:
        if sensor != self._pynvml.NVML_TEMPERATURE_GPU:
            raise self._error("INVALID_ARGUMENT")
        return self._field("nvmlDeviceGetTemperature", handle, "temperature")

    def nvmlDeviceGetPowerUsage(self, handle: Any) -> int:
        return self._field("nvmlDeviceGetPowerUsage", handle, "power_usage_mw")

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any) -> int:
        return self._field("nvmlDeviceGetEnforcedPowerLimit", handle, "power_limit_mw")

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any) -> int:
        return self._field("nvmlDeviceGetTotalEnergyConsumption", handle, "energy_mj")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any) -> int:
        return self._sub("nvmlDeviceGetCurrPcieLinkGeneration", handle, "pcie", "gen")

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any) -> int:
        return self._sub("nvmlDeviceGetCurrPcieLinkWidth", handle, "pcie", "width")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any) -> int:
        return self._sub("nvmlDeviceGetMaxPcieLinkGeneration", handle, "pcie", "gen_max")

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any) -> int:
        return self._sub("nvmlDeviceGetMaxPcieLinkWidth", handle, "pcie", "width_max")

    def _link(self, name: str, handle: Any, link: int) -> dict[str, Any]:
        links = self._field(name, handle, "nvlink")
        if not 0 <= link < len(links):
            raise self._error("INVALID_ARGUMENT")  # past the card's last link, as real NVML
        return links[link]

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: int) -> int:
        return int(bool(self._link("nvmlDeviceGetNvLinkState", handle, link).get("active")))

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: Any, link: int) -> SimpleNamespace:
        entry = self._link("nvmlDeviceGetNvLinkRemotePciInfo", handle, link)
        return SimpleNamespace(busId=self._answer(entry.get("remote_bus_id", "NOT_SUPPORTED")))

    def nvmlDeviceGetP2PStatus(self, h1: Any, h2: Any, p2p_index: int) -> int:
        if not isinstance(p2p_index, int):
            # ctypes refuses anything but an int; pynvml's own NVML_P2P_CAPS_INDEX_READ is (0,)
            raise TypeError(f"p2pIndex must be an int, got {p2p_index!r}")
        key = {
            self._pynvml.NVML_P2P_CAPS_INDEX_NVLINK: "p2p_nvlink",
            0: "p2p_read",  # NVML_P2P_CAPS_INDEX_READ
        }.get(p2p_index, f"p2p_{p2p_index}")
        return self._enum("NVML_P2P_STATUS_", self._pair("nvmlDeviceGetP2PStatus", h1, h2, key))

    def _processes(self, name: str, handle: Any, key: str) -> list[SimpleNamespace]:
        listed = self._field(name, handle, key)
        return [SimpleNamespace(pid=p["pid"], usedGpuMemory=p.get("used_bytes")) for p in listed]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses", handle, "compute_processes")

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Any) -> list[SimpleNamespace]:
        name = "nvmlDeviceGetGraphicsRunningProcesses"
        return self._processes(name, handle, "graphics_processes")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any) -> list[SimpleNamespace]:
        name = "nvmlDeviceGetComputeRunningProcesses_v2"
        return self._processes(name, handle, "compute_processes_v2")

    def nvmlDeviceGetGraphicsRunningProcesses_v2(self, handle: Any) -> list[SimpleNamespace]:
        name = "nvmlDeviceGetGraphicsRunningProcesses_v2"
        return self._processes(name, handle, "graphics_processes_v2")

    def recorded_process_name(self, pid: int) -> str | None:
        """The name the recording gives ``pid`` (the probe asks this instead of /proc)."""
        for device in self.devices:
            for key in ("compute_processes", "graphics_processes",
                        "compute_processes_v2", "graphics_processes_v2"):  # fmt: skip
                listed = device.get(key)
                for entry in listed if isinstance(listed, list) else ():
                    if entry.get("pid") == pid:
                        return entry.get("name")
        return None

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        current, pending = self._field("nvmlDeviceGetMigMode", handle, "mig_mode")
        return [current, pending]  # pynvml returns a list

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any) -> int:
        return self._field("nvmlDeviceGetMaxMigDeviceCount", handle, "max_mig_device_count")

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, index: int) -> _MigHandle:
        self._device("nvmlDeviceGetMigDeviceHandleByIndex", handle)
        count = self._answer(self.devices[handle.index].get("max_mig_device_count", 0))
        if not 0 <= index < count:
            raise self._error("INVALID_ARGUMENT")
        self._mig_entry(handle, index)
        return _MigHandle(handle, index)

    def nvmlDeviceGetTopologyCommonAncestor(self, h1: Any, h2: Any) -> int:
        level = self._pair("nvmlDeviceGetTopologyCommonAncestor", h1, h2, "topology")
        return self._enum("NVML_TOPOLOGY_", level)


def _host(data: Any, source: str) -> HostInfo | None:
    """The recorded host, so that host facts in tests do not depend on the test machine."""
    if data is None:
        return None
    try:
        return HostInfo(**data)
    except TypeError as err:
        raise HomelabError(f'{source}: bad "host" entry ({err})', _RECORDING_HINT) from None


def load_recording(path: str | Path) -> FakeNvml:
    """Read a recording JSON file into a `FakeNvml`."""
    path = Path(path)
    try:
        recording = json.loads(path.read_text(encoding="utf-8"))
    except OSError as err:
        raise HomelabError(
            f"cannot read the NVML recording {path}: {err.strerror}", _RECORDING_HINT
        ) from None
    except json.JSONDecodeError as err:
        raise HomelabError(
            f"{path}:{err.lineno}: the NVML recording is not valid JSON ({err.msg})",
            _RECORDING_HINT,
        ) from None
    if not isinstance(recording, dict):
        raise HomelabError(f"{path}: the NVML recording must be a JSON object", _RECORDING_HINT)
    return FakeNvml(recording, source=f"recording {path}")
