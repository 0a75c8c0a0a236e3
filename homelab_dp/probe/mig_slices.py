"""A card's MIG (Multi-Instance GPU) mode and its MIG instances, as NVML gives them.

With MIG on (A100, A30, H100, H200), CUDA sees the card only as its MIG instances, each one
device with its own memory and a ``MIG-...`` UUID, and a process gets one of them. Every call is
guarded like the rest of the probe: "not supported" (a card without MIG, an old driver), "not
found" (a MIG index that holds no instance) or any other NVML error is "not known", never a
crash.
"""

from __future__ import annotations

from typing import Any

from homelab_dp.probe.hardware import MigInfo, MigSlice

_MIG_ENABLE = 1  # NVML_DEVICE_MIG_ENABLE


def _ask(nvml: Any, name: str, *args: Any) -> Any:
    """``nvml.<name>(*args)``, or None when NVML cannot answer (or lacks the function)."""
    fn = getattr(nvml, name, None)
    if fn is None:
        return None
    try:
        return fn(*args)
    except nvml.NVMLError:
        return None


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\x00")
    return str(value)


def mig_info(nvml: Any, handle: Any) -> MigInfo | None:
    """The card's MIG mode (``nvmlDeviceGetMigMode``: current, pending) and, when it is on, its
    MIG instances (``nvmlDeviceGetMigDeviceHandleByIndex`` up to
    ``nvmlDeviceGetMaxMigDeviceCount``); None for a card without MIG. An index that holds no
    instance is skipped; a slice whose memory NVML does not give is listed with 0 bytes."""
    try:
        current, pending = _ask(nvml, "nvmlDeviceGetMigMode", handle)
    except (TypeError, ValueError):  # None (not supported) or an answer of another shape
        return None
    enabled = current == _MIG_ENABLE
    count = _ask(nvml, "nvmlDeviceGetMaxMigDeviceCount", handle) if enabled else 0
    slices = []
    for index in range(count if isinstance(count, int) else 0):
        mig = _ask(nvml, "nvmlDeviceGetMigDeviceHandleByIndex", handle, index)
        if mig is None:
            continue
        memory = _ask(nvml, "nvmlDeviceGetMemoryInfo", mig)
        slices.append(
            MigSlice(
                index=index,
                uuid=_text(_ask(nvml, "nvmlDeviceGetUUID", mig)),
                name=_text(_ask(nvml, "nvmlDeviceGetName", mig)),
                memory_bytes=getattr(memory, "total", None) or 0,
                memory_free=getattr(memory, "free", None),
                memory_used=getattr(memory, "used", None),
            )
        )
    return MigInfo(enabled, pending == _MIG_ENABLE, tuple(slices))
