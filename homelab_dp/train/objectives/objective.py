"""The objective seam: what the training loop asks of an objective, and which one a run uses.

The loop (`train.loop.training_loop.Trainer`) never branches on the objective's name. For every
optimizer step it sums the objective's per-block unit counts over every rank's blocks of the
step (``Data.units[whole].sum(0)``: counted on the host from the shared sample order, no
collective), then asks the objective

1. `Objective.begin_step` — anything the whole effective batch must agree on before the first
   micro-step (KTO's KL estimate: one no-grad pass and an all-reduce); a no-op for the others;
2. `Objective.micro_step` — forward, loss and backward of one micro-batch, the loss scaled by
   world / the step's global units (DDP and FSDP2 average gradients over ranks), so the step's
   gradient is that of the mean over the whole effective batch whatever the split across
   ranks and accumulation; it returns a 1-D float64 vector of detached metric sums;
3. `Objective.fields` — the event fields (``loss`` first) from the metric sums of every rank
   (reduced in the step log's one all-gather) and the global units.

An objective with a reference model gets it from `train.objectives.reference`. Per-block unit
counts, e.g. SFT: target tokens; DPO: pairs; ORPO: pairs and the chosen answers' target tokens;
KTO: completions, desirable and undesirable ones; GRPO: prompts (its `begin_step` generates and
scores their completions and agrees on the batch's advantages). A new objective is a new module
here and a line in `objective_for`: the loop stays as it is.

Optional, read with ``getattr`` (GRPO's ``iterations``): ``repeat``, the optimizer steps the
loop trains on each batch of data (1 when absent); ``checkpoint_state(rank)``, a collective
every rank calls before a checkpoint, its JSON-able answer saved in ``trainer.json`` under
``objective``; ``restore_state(state, device)``, given that back on resume (None: none saved).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from homelab_dp.errors import HomelabError
from homelab_dp.train.objectives.dpo import DpoObjective
from homelab_dp.train.objectives.grpo import GrpoObjective
from homelab_dp.train.objectives.kto import KtoObjective
from homelab_dp.train.objectives.orpo import OrpoObjective
from homelab_dp.train.objectives.sft import SftObjective

if TYPE_CHECKING:
    from collections.abc import Sequence

    import torch

    from homelab_dp.presets.preset import Preset


class Objective(Protocol):
    """One training objective as the loop sees it (see the module docstring)."""

    name: str
    """``train.objective``: sft, dpo, orpo, kto or grpo."""
    metrics: tuple[str, ...]
    """Names of the metric sums `micro_step` returns, in order."""

    def units(self, data: Any) -> torch.Tensor:
        """Per-block unit counts, ``[n_blocks, U]`` float64 (`train.loop.rank_setup.Data`)."""
        ...

    def begin_step(self, model: Any, data: Any, rank: Any, micro_idx: list[Any]) -> None:
        """Before the step's first micro-step, with this rank's micro-batches (block indices)."""
        ...

    def micro_step(
        self, model: Any, data: Any, idx: torch.Tensor, counts: Sequence[float], rank: Any,
        probe: Any = None, rows: Sequence[int] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Forward, scaled loss and backward of the blocks ``idx``; the detached metric sums.
        ``rows`` is ``idx`` as Python ints (the loop has them without a read)."""
        ...

    def fields(self, sums: Sequence[float], counts: Sequence[float]) -> dict[str, float | None]:
        """Event fields (``loss`` and the objective's own) from the effective batch's sums."""
        ...


class PairEvaluation(Protocol):
    """What a preference objective adds for the in-training evaluation of held-out pairs
    (`train.evaluation.eval_loss.evaluate_pairs`); SFT's eval is the token loss (`train.evaluation.eval_loss`)."""

    def eval_units(self, pairs: Any) -> torch.Tensor:
        """Per-block unit counts of `train.objectives.pair_batch.PairData`, as `units`."""
        ...

    def eval_sums(self, model: Any, pairs: Any, idx: torch.Tensor, device: Any) -> torch.Tensor:
        """The metric sums of the blocks ``idx`` without a backward (no grad, eval mode)."""
        ...


def objective_for(
    preset: Preset, *, method: str, reference: Any = None, run_dir: Any = None,
    start_step: int = 0,
) -> Objective:  # fmt: skip
    """The objective ``preset.train.objective`` names, for a run of ``method`` (full, lora,
    qlora); ``reference`` is the `train.objectives.reference.Reference` of DPO/KTO; GRPO
    writes its rollouts under ``run_dir`` and counts its steps from ``start_step``."""
    train = preset.train
    name = train.objective
    if name == "sft":
        return SftObjective()
    if name == "grpo":
        return GrpoObjective(preset, run_dir, start_step)
    if name == "orpo":
        return OrpoObjective(train.orpo_lambda)
    if reference is None:
        raise HomelabError(f"train.objective = {name!r} needs a reference model",
                           hint="set train.reference")  # fmt: skip
    if name == "dpo":
        return DpoObjective(reference, beta=train.beta, loss_type=train.dpo_loss,
                            label_smoothing=train.label_smoothing)  # fmt: skip
    if name == "kto":
        return KtoObjective(reference, beta=train.beta)
    raise HomelabError(f"train.objective = {name!r} is not an objective",
                       hint="use sft, dpo, orpo, kto or grpo")  # fmt: skip
