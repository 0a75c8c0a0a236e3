"""Where a relaunch of a run continues: the step of its newest usable checkpoint (a `resume`),
and the changed batch after out-of-memory (the keeper's ``--auto-fit`` retry, asked of planning)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from homelab_dp.planning.batch_shape import BatchShape, after_out_of_memory
from homelab_dp.runs.folder.run_folder import read_run_spec, write_run_spec

MAX_OOM_RETRIES = 3
"""How often the keeper of an ``--auto-fit`` run retries after out-of-memory."""
_STEP_DIR = re.compile(r"^step-(\d+)$")


def resume_step(run_dir: Path) -> int:
    """The step a resume of this run continues from: its newest complete checkpoint's
    (``checkpoints/step-N`` with its COMPLETE marker, the layout of `homelab_dp.train.loop.checkpoints`;
    the worker also checks the shards and falls back to an older one if they are damaged), or 0
    when it has none and starts again from step 1 (its earlier steps are trained again)."""
    steps = []
    try:
        folders = list((run_dir / "checkpoints").iterdir())
    except OSError:
        return 0
    for folder in folders:
        match = _STEP_DIR.match(folder.name)
        try:
            marker = json.loads((folder / "COMPLETE").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if match and isinstance(marker, dict) and "step" in marker:
            steps.append(int(match.group(1)))
    return max(steps, default=0)


def apply_oom_proposal(run_dir: Path, failure: dict[str, Any]) -> str | None:
    """After a rank ran out of memory, rewrite the run's spec with planning's next batch
    (`homelab_dp.planning.batch_shape.after_out_of_memory`), ready to resume; None when the
    failure was no out-of-memory or planning has nothing left to try.

    The effective batch is unchanged, so the resumed run continues exactly from its last
    checkpoint. Returns a one-line description of the change.
    """
    if failure.get("kind") != "oom":
        return None
    spec = read_run_spec(run_dir)
    r = spec.resolved
    batch = BatchShape.of(r.micro_batch, r.world_size, r.grad_accum, r.sequence_parallel)
    fallback = after_out_of_memory(batch, r.activation_checkpointing)
    if fallback is None:
        return None
    changed = spec.with_batch(fallback.batch.micro, fallback.batch.accum, fallback.checkpointing)
    before, after = changed.retries[-1].before, changed.retries[-1].after
    if after == before:
        return None
    write_run_spec(run_dir, changed)
    ac = ", activation checkpointing on" if after[2] and not before[2] else ""
    return (f"out of memory: retrying with micro-batch {after[0]} × accumulation {after[1]}"
            f"{ac} (same effective batch {fallback.batch.effective})")  # fmt: skip
