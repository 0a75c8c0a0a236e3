"""What `homelab-dp measure` stored for the hardware a plan is for (the calibration lookup).

The fingerprint names the devices, driver and torch version; a what-if GPU size has none.
"""

from __future__ import annotations

from homelab_dp.core.calibration import (
    CalibrationStore,
    HardwareCalibration,
    fingerprint,
    torch_version,
)
from homelab_dp.core.hardware import HardwareReport, PlanHardware
from homelab_dp.core.memory import assumed_overhead


def hardware_fingerprint(hw: PlanHardware, report: HardwareReport | None) -> str | None:
    """The fingerprint of the devices a plan is for, or None for a what-if GPU size."""
    if hw.kind == "cuda":
        if report is None or not report.gpus:
            return None  # `--gpus 2x24GiB`: hardware that is not here
        names = [g.name for g in report.gpus if not hw.indices or g.index in hw.indices]
        return fingerprint("cuda", device_names=names, driver=report.driver_version,
                           torch=torch_version())  # fmt: skip
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
