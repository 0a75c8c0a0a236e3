"""A Hugging Face hub cache laid out on disk, offline: the tests of models by id use it.

The layout is huggingface_hub's own (``models--org--name/blobs/<sha256>``,
``snapshots/<commit>/<file>`` linked to its blob, ``refs/<branch>`` holding the commit), so
huggingface_hub finds the files exactly as it finds downloaded ones. The environment points
HF_HUB_CACHE and HF_HOME at it and sets HF_HUB_OFFLINE=1 (spawned processes inherit it): no
test ever reaches the network.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "assets" / "models" / "tiny-llama"
REPO_ID = "homelab-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
"""The snapshot refs/main names."""
TAG_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"
"""A second snapshot, named by the tag ``v1`` only: config.json alone (planning only)."""


def add_snapshot(
    cache: Path, repo_id: str, commit: str, files: list[Path], refs: tuple[str, ...] = ("main",)
) -> Path:
    """Put ``files`` into the cache as the snapshot ``commit`` of ``repo_id``, named by
    ``refs``; returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo / "blobs").mkdir(exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    for src in files:
        data = src.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        if not blob.exists():
            blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / src.name)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit, encoding="ascii")
    return snapshot


def make_hub_cache(cache: Path) -> Path:
    """The demo model as ``REPO_ID`` in ``cache``: the whole model at main (``COMMIT``), and
    config.json alone at the tag v1 (``TAG_COMMIT``). Returns main's snapshot folder."""
    files = sorted(p for p in DEMO_MODEL.iterdir() if p.name != "README.md")
    main = add_snapshot(cache, REPO_ID, COMMIT, files)
    add_snapshot(cache, REPO_ID, TAG_COMMIT, [DEMO_MODEL / "config.json"], refs=("v1",))
    return main


def use_hub_cache(monkeypatch: pytest.MonkeyPatch, cache: Path) -> None:
    """Point this process (and what it spawns) at ``cache``, offline."""
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HOME", str(cache.parent / "hf-home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
