"""A GRPO run's rollouts: ``<run>/rollouts/step-NNNNNN.jsonl``, one line per completion.

Rank 0 writes each generating step's file whole (a temporary file renamed), so a reader sees a
complete file or none: ``prompt_index``, ``completion``, ``reward`` (the weighted total) and
``rewards`` (each function's, by name). `latest_rollouts` is what the Monitor shows.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from homelab_dp.runs.folder.jsonl_tail import json_objects

ROLLOUTS = "rollouts"
"""The run folder's rollouts folder (none with ``grpo.rollouts = false``)."""


def rollout_path(run_dir: Path, step: int) -> Path:
    """``<run>/rollouts/step-NNNNNN.jsonl`` of optimizer step ``step`` (1-based)."""
    return run_dir / ROLLOUTS / f"step-{step:06d}.jsonl"


@dataclass(frozen=True)
class Rollouts:
    """One generating step's completions, in prompt order."""

    step: int
    rows: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    path: str = ""


def latest_rollouts(run_dir: Path) -> Rollouts | None:
    """The newest step's rollouts (None: no rollouts folder or file; lines that are not JSON
    objects are left out)."""
    folder = run_dir / ROLLOUTS
    try:
        files = sorted(folder.glob("step-*.jsonl"))
    except OSError:
        return None
    for path in reversed(files):
        try:
            step = int(path.stem.split("-", 1)[1])
            text = path.read_text(encoding="utf-8")
        except (ValueError, OSError):
            continue
        return Rollouts(step, tuple(json_objects(text.splitlines())), str(path))
    return None
