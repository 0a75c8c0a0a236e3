"""The CPU host: what a CPU plan budgets for, and what the probe reports when there is no GPU."""

from __future__ import annotations

import os
import platform
from typing import Any

from homelab_dp.probe.fake_nvml import FAKE_ENV, load_recording
from homelab_dp.probe.hardware import HostInfo


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(":")
                if key.strip() in ("model name", "Model") and value.strip():
                    return value.strip()
    except OSError:
        pass  # not Linux, or /proc hidden: fall back to what platform knows
    return platform.processor() or platform.machine() or "unknown CPU"


def host_info(nvml: Any = None) -> HostInfo:
    """The CPU host: CPU model, logical and physical cores, RAM total and available.

    When a recording stands in for NVML (`nvml` is a `FakeNvml`, or ``HOMELAB_DP_FAKE_NVML`` is
    set) and it records a host, that host is returned, so recorded hardware is deterministic.
    """
    if nvml is None and os.environ.get(FAKE_ENV):
        nvml = load_recording(os.environ[FAKE_ENV])
    recorded = getattr(nvml, "recorded_host", None)
    if isinstance(recorded, HostInfo):
        return recorded
    try:
        import psutil
    except ImportError:  # a declared dependency, but the probe should still answer without it
        psutil = None
    logical = (psutil.cpu_count(logical=True) if psutil else None) or os.cpu_count() or 1
    physical = psutil.cpu_count(logical=False) if psutil else None
    if psutil:
        memory = psutil.virtual_memory()
        ram_total, ram_available = int(memory.total), int(memory.available)
    else:
        ram_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        ram_available = None
    return HostInfo(
        cpu_model=_cpu_model(),
        logical_cores=logical,
        physical_cores=physical,
        ram_total=ram_total,
        ram_available=ram_available,
    )
