"""Which reference model a DPO/KTO run uses (``train.reference``), without torch.

Pure, so a front end's preflight or the planner can resolve and refuse the choice before
anything is spawned; the worker (`train.objectives.reference`) builds what it names.
"""

from __future__ import annotations

from typing import Any

from homelab_dp.errors import HomelabError
from homelab_dp.planning.objective_cost import REFERENCE_OBJECTIVES, resolve_reference


def reference_kind(preset: Any, method: str) -> str | None:
    """``train.reference`` resolved for a run of ``method``; None for an objective without one.
    Raises HomelabError for a choice the method cannot have."""
    train = preset.train
    if train.objective not in REFERENCE_OBJECTIVES:
        return None
    want = train.reference
    lora = method in ("lora", "qlora")
    if want == "adapters" and not lora:
        raise HomelabError(
            f"train.reference = 'adapters' needs LoRA or QLoRA (train.method is {method!r})",
            hint="set train.reference = 'precompute' (or 'copy') for a full fine-tune",
        )
    if want == "copy" and lora:
        raise HomelabError(
            "train.reference = 'copy' is for a full fine-tune: LoRA's reference is its base",
            hint="set train.reference = 'adapters' (or 'auto')",
        )
    return resolve_reference(train.objective, want, method)  # the planner's rule, one place
