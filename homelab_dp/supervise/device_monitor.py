"""The device monitor: a small process beside each run that samples the devices every second.

``python -m homelab_dp.supervise.device_monitor RUN_DIR [--interval 1.0]`` appends one line per sample to
``RUN_DIR/devices.jsonl``: per GPU through NVML (utilisation, memory, temperature, power,
energy), or per rank through psutil on the CPU (CPU %, RSS). Energy per run comes from NVML's
energy counter (the difference since the first sample), or from integrating power where the
counter is not supported. It ends by itself when the run's processes are gone.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from homelab_dp import json_safe
from homelab_dp.probe.nvml import NvmlSession
from homelab_dp.runs.folder.run_folder import read_run_spec
from homelab_dp.runs.folder.run_state import pid_alive, read_state

MJ_PER_WH = 3.6e6


class EnergyMeter:
    """Energy per device since the run started: counter difference, else integrated power."""

    def __init__(self) -> None:
        self._first_counter: dict[str, float] = {}
        self._integrated: dict[str, float] = {}
        self._last_time: dict[str, float] = {}

    def update(self, key: str, now: float, energy_mj: float | None, power_w: float | None) -> float:
        """Wh used by device ``key`` so far."""
        if energy_mj is not None:
            first = self._first_counter.setdefault(key, energy_mj)
            return max(energy_mj - first, 0.0) / MJ_PER_WH
        last = self._last_time.get(key)
        self._last_time[key] = now
        if power_w is not None and last is not None:
            self._integrated[key] = self._integrated.get(key, 0.0) + power_w * (now - last) / 3600
        return self._integrated.get(key, 0.0)


class DeviceSampler:
    """Samples the run's GPUs (NVML) or its rank processes (psutil) into dicts."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        spec = read_run_spec(run_dir)
        self.device = spec.resolved.device
        self.indices = list(spec.launch.gpu_indices) or None
        self.energy = EnergyMeter()
        self._procs: dict[int, psutil.Process] = {}
        self._nvml = None
        if self.device == "cuda":
            self._nvml = NvmlSession()
            self._nvml.open()

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()

    def sample(self) -> dict[str, Any]:
        now = time.time()
        devices = self._gpus(now) if self._nvml is not None else self._ranks()
        total = sum(d.get("energy_wh") or 0.0 for d in devices)
        return {"type": "devices", "time": now, "devices": devices, "energy_wh": total}

    def _gpus(self, now: float) -> list[dict[str, Any]]:
        assert self._nvml is not None
        out = []
        for s in self._nvml.sample(self.indices):
            key = f"gpu{s['index']}"
            s = {**s, "key": key}
            s["energy_wh"] = self.energy.update(key, now, s.get("energy_mj"), s.get("power_w"))
            out.append(s)
        return out

    def _ranks(self) -> list[dict[str, Any]]:
        workers = list(read_state(self.run_dir).get("pids", {}).get("workers") or [])
        out = []
        for rank, pid in enumerate(workers):
            proc = self._procs.get(pid)
            try:
                if proc is None:
                    proc = self._procs[pid] = psutil.Process(pid)
                    proc.cpu_percent(None)  # the first call only sets the baseline
                with proc.oneshot():
                    out.append(
                        {
                            "key": f"rank{rank}",
                            "utilization_pct": proc.cpu_percent(None),
                            "memory_used": proc.memory_info().rss,
                            "memory_total": psutil.virtual_memory().total,
                        }
                    )
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out


def run_alive(run_dir: Path) -> bool:
    """The run's keeper or torchrun agent is still there."""
    pids = read_state(run_dir).get("pids") or {}
    return pid_alive(pids.get("keeper")) or pid_alive(pids.get("agent"))


def monitor(run_dir: Path, interval: float = 1.0, max_samples: int | None = None) -> int:
    """Sample until the run's processes are gone (or ``max_samples``); return samples written."""
    stop = {"flag": False}

    def _stop(signum: int, frame: Any) -> None:
        stop["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    sampler = DeviceSampler(run_dir)
    written = 0
    try:
        with open(run_dir / "devices.jsonl", "a", encoding="utf-8") as out:
            while not stop["flag"]:
                out.write(json_safe.dumps(sampler.sample()) + "\n")
                out.flush()
                written += 1
                if max_samples is not None and written >= max_samples:
                    break
                time.sleep(interval)
                if not run_alive(run_dir):
                    break
    finally:
        sampler.close()
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="homelab-dp device monitor")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    monitor(args.run_dir, args.interval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
