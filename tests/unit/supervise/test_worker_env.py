"""The environment a run's workers get on the CPU: OpenMP threads shared out, waiting passively."""

from __future__ import annotations

from pathlib import Path

import pytest

from homelab_dp.presets.preset_store import open_preset
from homelab_dp.runs.run_spec import Launch, Resolved, RunSpec
from homelab_dp.supervise.launcher import worker_env


def _spec(device: str) -> RunSpec:
    preset = open_preset("tiny-demo", [])
    resolved = Resolved("full", "ddp", False, device, 2, "fp32", 1, 1, 1e-4)
    return RunSpec("r", preset, resolved, Launch(2))


def test_cpu_workers_wait_passively_unless_the_user_says_otherwise(
    monkeypatch: pytest.MonkeyPatch, in_repo: Path
) -> None:
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert worker_env(_spec("cpu"))["OMP_WAIT_POLICY"] == "PASSIVE"
    assert "OMP_WAIT_POLICY" not in worker_env(_spec("cuda"))  # the card computes, not OpenMP
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert worker_env(_spec("cpu"))["OMP_WAIT_POLICY"] == "ACTIVE"
