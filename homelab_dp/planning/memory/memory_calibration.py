"""Measured memory, kept per hardware fingerprint, and the overhead terms corrected from it.

`homelab-dp measure` records, for one configuration on one machine, the planner's estimate beside
the measured peak of tensor memory (live tensor bytes on the CPU, ``max_memory_allocated`` on
CUDA) and the process-level peak (the resident set on the CPU, ``max_memory_reserved`` and the
device's used memory on CUDA). Later plans on the same hardware:

* show the measured figures beside the estimate when the configuration matches one measured;
* replace the assumed overhead (runtime, fragmentation) with what was measured: on CUDA the
  fragmentation is ``reserved / allocated - 1`` and the runtime (context, NCCL) is the device's
  used memory minus the reserved; on the CPU everything the process holds beyond its tensors is
  runtime, and with measurements of different sizes a line ``runtime + fraction × tensors`` is
  fitted to them.

The file is ``$XDG_DATA_HOME/homelab-dp/calibration.json`` (``~/.local/share`` by default), a
`homelab_dp.user_files.fingerprint_store.FingerprintStore` as the speed calibration's is. It is
not trusted: only a regular file of bounded size is read (a FIFO or a link to ``/dev/zero``
there is ignored), and every measurement is checked (`Measurement.problem`: types, ranges,
finite numbers); one that does not pass is left out, said in `CalibrationStore.problem`, and
gone from the file the next time it is written. A fingerprint is the device kind, the GPU model (or the CPU model), the driver and torch's version
— read from package metadata, so that nothing here imports torch.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from homelab_dp.byte_units import format_bytes
from homelab_dp.planning.memory.device_memory import COMPONENTS, Budget, Overhead, TrainShape
from homelab_dp.user_files.fingerprint_store import (
    KEEP_PER_FINGERPRINT,
    Check,
    FingerprintStore,
    StoredRecord,
    is_int,
    is_number,
    is_scalar_map,
    is_text,
)
from homelab_dp.user_files.paths import data_home

MAX_BYTES = 2**62
"""The largest byte count a record may hold (anything above is no measurement)."""


def calibration_path() -> Path:
    """``$XDG_DATA_HOME/homelab-dp/calibration.json``."""
    return data_home() / "calibration.json"


def torch_version() -> str | None:
    """torch's installed version, from package metadata (torch is not imported)."""
    from importlib import metadata  # ~0.1 s to import: only when a fingerprint is needed

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def fingerprint(
    kind: str,
    *,
    device_names: Iterable[str] = (),
    driver: str | None = None,
    cpu_model: str | None = None,
    torch: str | None = None,
) -> str:
    """One line naming the hardware and software that memory figures depend on."""
    parts = [kind]
    if kind == "cuda":
        parts += [" + ".join(sorted(set(device_names))) or "unknown GPU", f"driver {driver or '?'}"]
    else:
        parts.append(cpu_model or "unknown CPU")
    parts.append(f"torch {torch or '?'}")
    return " | ".join(parts)


def config_key(model: dict[str, Any], shape: TrainShape) -> dict[str, Any]:
    """What makes two measurements comparable: the model's sizes and the training shape."""
    keep = ("model_type", "params", "layers", "hidden", "vocab")
    # The data's target share refines an estimate; it does not make another configuration.
    # Whole sequences (sequence_parallel 1) stay out: what was measured before it still matches.
    shape_key = {k: v for k, v in asdict(shape).items()
                 if k != "target_share" and (k, v) != ("sequence_parallel", 1)}  # fmt: skip
    return {"model": {k: model.get(k) for k in keep}, "shape": shape_key}


def _is_phases(value: Any) -> bool:
    return isinstance(value, dict) and all(
        is_text(k) and type(v) is int and 0 <= v <= MAX_BYTES for k, v in value.items()
    )


def _is_key(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"model", "shape"}
        and is_scalar_map(value["model"])
        and is_scalar_map(value["shape"])
    )


MEASUREMENT_CHECKS: dict[str, Check] = {
    "fingerprint": lambda v: is_text(v) and bool(v),
    "key": _is_key,
    "kind": lambda v: v in ("live_tensor_bytes", "cuda_max_allocated"),
    "estimate_tensor_bytes": is_int(0, MAX_BYTES),
    "estimate_peak_phase": is_text,
    "measured_tensor_bytes": is_int(0, MAX_BYTES),
    "measured_peak_phase": is_text,
    "estimate_phases": _is_phases,
    "measured_phases": _is_phases,
    "process_peak_bytes": is_int(0, MAX_BYTES, optional=True),
    "runtime_bytes": is_int(0, MAX_BYTES, optional=True),
    "time": is_number(0, 1e12),
    "run_id": is_text,
}
"""What each field of a stored measurement must be (`Measurement.problem` checks them)."""


@dataclass(frozen=True)
class Measurement(StoredRecord):
    """One configuration measured on one machine (the largest figure over its ranks); a
    record of the calibration file (`CalibrationStore`)."""

    CHECKS: ClassVar[dict[str, Check]] = MEASUREMENT_CHECKS

    fingerprint: str
    key: dict[str, Any]
    kind: str
    """"live_tensor_bytes" (CPU) or "cuda_max_allocated"."""
    estimate_tensor_bytes: int
    estimate_peak_phase: str
    measured_tensor_bytes: int
    measured_peak_phase: str
    estimate_phases: dict[str, int] = field(default_factory=dict)
    measured_phases: dict[str, int] = field(default_factory=dict)
    process_peak_bytes: int | None = None
    """CPU: the resident-set peak; CUDA: ``max_memory_reserved``."""
    runtime_bytes: int | None = None
    """CUDA only: device memory in use beyond the caching allocator (context, NCCL)."""
    time: float = 0.0
    run_id: str = ""

    @property
    def error(self) -> float:
        """(estimate − measured) / measured: positive when the plan over-estimates."""
        return (self.estimate_tensor_bytes - self.measured_tensor_bytes) / max(
            self.measured_tensor_bytes, 1
        )


def corrected_overhead(measurements: list[Measurement], assumed: Overhead) -> Overhead:
    """The overhead terms as measured; ``assumed`` fills what the measurements cannot tell."""
    usable = [m for m in measurements if m.process_peak_bytes and m.measured_tensor_bytes > 0]
    if not usable:
        return assumed
    when = time.strftime("%Y-%m-%d", time.localtime(max(m.time for m in usable)))
    source = f"measured on this hardware, {len(usable)} run(s), last {when}"
    if usable[0].kind == "cuda_max_allocated":
        frag = _mean((m.process_peak_bytes or 0) / m.measured_tensor_bytes - 1 for m in usable)
        runtimes = [m.runtime_bytes for m in usable if m.runtime_bytes is not None]
        runtime = int(_mean(runtimes)) if runtimes else assumed.runtime_bytes
        return Overhead(max(runtime, 0), min(max(frag, 0.0), 1.0), source, source)
    # CPU: non-tensor bytes o = runtime + f × tensors; fit f only when the sizes differ enough.
    t = [float(m.measured_tensor_bytes) for m in usable]
    o = [float((m.process_peak_bytes or 0) - m.measured_tensor_bytes) for m in usable]
    frac, frac_source = assumed.fragmentation, "assumed"
    if len(usable) > 1 and max(t) > 1.5 * min(t):
        tm, om = _mean(t), _mean(o)
        cov = sum((a - tm) * (b - om) for a, b in zip(t, o, strict=True))
        var = sum((a - tm) ** 2 for a in t)
        frac, frac_source = min(max(cov / var, 0.0), 0.5), source
    runtime = _mean(oi - frac * ti for oi, ti in zip(o, t, strict=True))
    return Overhead(int(max(runtime, 0.0)), frac, source, frac_source)


def _mean(values: Iterable[float]) -> float:
    vals = list(values)
    return sum(vals) / len(vals) if vals else 0.0


@dataclass(frozen=True)
class HardwareCalibration:
    """What is known about one machine: its measurements and the overhead derived from them."""

    fingerprint: str | None
    """None when the plan is for hardware that is not here (a what-if ``--gpus`` size)."""
    measurements: tuple[Measurement, ...] = ()
    overhead: Overhead | None = None
    """The measured overhead terms, or None when nothing was measured."""

    def match(self, key: dict[str, Any]) -> Measurement | None:
        """The newest measurement of exactly this configuration."""
        found = [m for m in self.measurements if m.key == key]
        return max(found, key=lambda m: m.time) if found else None


class CalibrationStore(FingerprintStore[Measurement]):
    """The calibration file: measurements of every fingerprint seen on this account (its
    ``problem``: what could not be read, see `FingerprintStore`)."""

    def __init__(self, path: Path | None = None) -> None:
        super().__init__(path or calibration_path(), "measurements", Measurement,
                         keep=KEEP_PER_FINGERPRINT)  # fmt: skip

    @property
    def measurements(self) -> list[Measurement]:
        """The measurements read or added, in file order."""
        return self.records

    def for_hardware(self, fp: str | None, assumed: Overhead) -> HardwareCalibration:
        """The calibration of one fingerprint (empty for None or an unknown machine)."""
        if fp is None:
            return HardwareCalibration(None)
        mine = tuple(self.of(fp))
        overhead = corrected_overhead(list(mine), assumed) if mine else None
        if overhead is not None and overhead.source == "assumed":
            overhead = None
        return HardwareCalibration(fp, mine, overhead)

    def add(self, m: Measurement) -> None:  # type: ignore[override]
        """Record ``m``, replacing an earlier measurement of the same configuration."""
        super().add(m, replaces=lambda x: (x.fingerprint, x.key) == (m.fingerprint, m.key))


def calibration_json(
    cal: HardwareCalibration | None, measured: Measurement | None, chosen: Budget, assumed: Overhead
) -> dict[str, Any]:
    """The plan's ``calibration`` block: which numbers are measured, estimated or assumed."""
    ov = (cal.overhead if cal else None) or assumed
    sources = dict.fromkeys(COMPONENTS, "estimate")
    sources["overhead"] = "assumed" if ov.source == "assumed" else "measured"
    sources["tensors"] = "measured" if measured is not None else "estimate"
    seen = None
    if measured is not None:
        m, est = measured, chosen.tensors
        seen = {
            "kind": m.kind,
            "tensor_bytes": m.measured_tensor_bytes,
            "peak_phase": m.measured_peak_phase,
            "phases": m.measured_phases,
            "process_peak_bytes": m.process_peak_bytes,
            "estimate_tensor_bytes": est,
            "error": (est - m.measured_tensor_bytes) / max(m.measured_tensor_bytes, 1),
            "time": m.time,
            "run_id": m.run_id,
        }
    return {
        "fingerprint": cal.fingerprint if cal else None,
        "measurements": len(cal.measurements) if cal else 0,
        "overhead": {
            "runtime_bytes": ov.runtime_bytes,
            "fragmentation": ov.fragmentation,
            "source": ov.source,
            "fragmentation_source": ov.fragmentation_source,
        },
        "measured": seen,
        "sources": sources,
    }


def measured_reasons(
    estimate: int, m: Measurement | None, calibration: HardwareCalibration
) -> list[str]:
    """The plan's reasons about measurements on this hardware."""
    if m is None:
        n = len(calibration.measurements)
        if not n:
            return []
        return [f"{n} measurement(s) on this hardware correct the overhead terms; this exact "
                "configuration was not measured (`homelab-dp measure` does it)."]  # fmt: skip
    err = (estimate - m.measured_tensor_bytes) / max(m.measured_tensor_bytes, 1)
    return [
        f"Measured on this hardware: peak tensor memory {format_bytes(m.measured_tensor_bytes)} "
        f"in the {m.measured_peak_phase} phase, estimate {format_bytes(estimate)} "
        f"({100 * err:+.1f}%)."
    ]
