"""`homelab-dp probe` and the TUI's Hardware screen: what this machine has (`probe.nvml`)."""

from __future__ import annotations

from homelab_dp.probe.hardware import HardwareReport
from homelab_dp.probe.nvml import probe

__all__ = ["HardwareReport"]  # the report the front ends show


def probe_machine() -> HardwareReport:
    """The GPUs through NVML, or the CPU host when there is none (never raises for missing
    hardware; a bad ``HOMELAB_DP_FAKE_NVML`` recording is a HomelabError)."""
    return probe()
