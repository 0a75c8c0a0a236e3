"""Which processes hold memory on a GPU: NVML's running compute and graphics processes.

Every call is guarded like the rest of the probe: a driver that does not support the query, no
permission, or an nvidia-ml-py newer than the driver (its unversioned call then raises
``NVMLLibraryMismatchError``, which is not an NVMLError; the older ``_v2`` call is tried) gives
None ("not known"), never a crash. A process's name comes from a recording, else psutil, else
``/proc/PID/comm``; a pid from another PID namespace (a container) may have no name here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from homelab_dp.probe.hardware import GpuProcess

_KINDS = ("compute", "graphics")
_NOT_AVAILABLE = 2**64 - 1  # NVML_VALUE_NOT_AVAILABLE_ulonglong, when pynvml passes it through


def _errors(nvml: Any) -> tuple[type[BaseException], ...]:
    """The exceptions that mean "NVML cannot answer this" for the process queries."""
    found = [nvml.NVMLError]
    mismatch = getattr(nvml, "NVMLLibraryMismatchError", None)
    if isinstance(mismatch, type) and issubclass(mismatch, BaseException):
        found.append(mismatch)
    return tuple(found)


def _listed(nvml: Any, kind: str, handle: Any) -> list[Any] | None:
    """``nvmlDeviceGet{Compute,Graphics}RunningProcesses``, then its ``_v2``; None if neither
    answers."""
    base = f"nvmlDeviceGet{kind.capitalize()}RunningProcesses"
    for name in (base, f"{base}_v2"):
        fn = getattr(nvml, name, None)
        if fn is None:
            continue
        try:
            return list(fn(handle))
        except _errors(nvml):
            continue  # not supported, or the driver lacks this version: try the older one
    return None


def _used(value: Any) -> int | None:
    if not isinstance(value, int) or value < 0 or value >= _NOT_AVAILABLE:
        return None
    return value


def process_name(pid: int, nvml: Any = None) -> str | None:
    """The name of process ``pid``: a recording's, else psutil's, else /proc; None if unknown."""
    recorded = getattr(nvml, "recorded_process_name", None)
    if callable(recorded):
        return recorded(pid)
    try:
        import psutil
    except ImportError:  # a declared dependency, but the probe answers without it
        psutil = None
    if psutil is not None:
        try:
            return psutil.Process(pid).name() or None
        except (psutil.Error, OSError):  # gone, no permission, a zombie
            return None
    try:
        return Path(f"/proc/{pid}/comm").read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def running_processes(nvml: Any, handle: Any) -> tuple[GpuProcess, ...] | None:
    """The compute and graphics processes on one GPU, one per pid (largest first); None when
    NVML answered neither list."""
    found: dict[int, GpuProcess] = {}
    answered = False
    for kind in _KINDS:
        listed = _listed(nvml, kind, handle)
        if listed is None:
            continue
        answered = True
        for entry in listed:
            pid = getattr(entry, "pid", None)
            if not isinstance(pid, int):
                continue
            used = _used(getattr(entry, "usedGpuMemory", None))
            seen = found.get(pid)
            if seen is None:
                found[pid] = GpuProcess(pid, process_name(pid, nvml), used, kind)
                continue
            # Listed as both (nvidia-smi's C+G): each list gives the process's memory; count it once
            both = max(u for u in (seen.used_bytes, used, -1) if u is not None)
            found[pid] = GpuProcess(pid, seen.name, None if both < 0 else both,
                                    f"{seen.kind}+{kind}" if kind not in seen.kind else seen.kind)  # fmt: skip
    if not answered:
        return None
    return tuple(sorted(found.values(), key=lambda p: (-(p.used_bytes or 0), p.pid)))
