"""Shared test fixtures: the repository root and recorded hardware."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"


@pytest.fixture
def in_repo(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from the repository root, with runs and user presets in temporary folders."""
    monkeypatch.chdir(ROOT)
    return ROOT


@pytest.fixture(autouse=True)
def _private_dirs(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    """Never touch the user's real runs folder, saved presets or memory calibration."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.mktemp("xdg")))
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path_factory.mktemp("xdg-data")))
    monkeypatch.setenv("HOMELAB_DP_RUNS", str(tmp_path_factory.mktemp("runs")))
    monkeypatch.delenv("HOMELAB_DP_PRESETS", raising=False)
