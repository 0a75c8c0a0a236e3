"""DPO: Direct Preference Optimization on chosen/rejected pairs, against a reference model.

The unit is the pair: the step's loss is the mean per-pair loss over every pair of the
effective batch (`train.objectives.preference_losses.dpo_loss`: sigmoid with label smoothing,
or IPO on length-averaged log-probabilities, as TRL), each micro-batch's sum scaled by
world / the step's pairs. The metric sums (loss, chosen and rejected rewards, pairs ranked
right) become the step event's rewards_chosen, rewards_rejected, reward_margin and
reward_accuracy (means over the pairs).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from homelab_dp.train.objectives.pair_batch import batch_of, forward_logps
from homelab_dp.train.objectives.preference_losses import dpo_loss
from homelab_dp.train.objectives.preference_step import PreferenceStep, float64_sums

if TYPE_CHECKING:
    from collections.abc import Sequence


def pair_means(sums: Sequence[float], pairs: float) -> dict[str, float | None]:
    """DPO's event fields from [loss, chosen rewards, rejected rewards, right] sums."""
    if not pairs:
        return {"loss": float("nan")}
    return {
        "loss": sums[0] / pairs, "rewards_chosen": sums[1] / pairs,
        "rewards_rejected": sums[2] / pairs, "reward_margin": (sums[1] - sums[2]) / pairs,
        "reward_accuracy": sums[3] / pairs,
    }  # fmt: skip


class DpoObjective(PreferenceStep):
    """`train.objectives.objective.Objective` of DPO (see the module docstring)."""

    name = "dpo"
    metrics = ("loss_sum", "rewards_chosen_sum", "rewards_rejected_sum", "right_pairs")

    def __init__(self, reference: Any, *, beta: float, loss_type: str, label_smoothing: float):
        self.reference = reference
        """`train.objectives.reference`: AdapterReference, PrecomputedReference or CopyReference."""
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing

    def eval_units(self, pairs: Any) -> torch.Tensor:
        """Pairs per block, ``[n_blocks, 1]``."""
        return pairs.n_pairs.to(torch.float64)[:, None]

    def parts(
        self, model: Any, pairs: Any, idx: torch.Tensor, device: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the pairs' loss sum, with grad when enabled; chosen rewards, rejected rewards) of the
        blocks ``idx``."""
        batch = batch_of(pairs, idx, device, flat=model.flat_batches)
        ref = self.reference.logps(model, pairs, batch)
        logps, counts = forward_logps(model.strategy.model, batch, autocast=model.autocast,
                                      dtype=model.loss_dtype)  # fmt: skip
        if self.loss_type == "ipo":  # length-averaged, as TRL's IPO
            n = counts.clamp(min=1).to(logps.dtype)
            logps, ref = logps / n, ref / n
        losses, chosen, rejected = dpo_loss(
            logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta=self.beta,
            loss_type=self.loss_type, label_smoothing=self.label_smoothing,
        )  # fmt: skip
        return losses.sum(), chosen, rejected

    def step_loss(
        self, parts: tuple[Any, ...], counts: Sequence[float], world: int
    ) -> torch.Tensor:
        """The loss sum scaled by world / the step's pairs."""
        return parts[0] * (world / max(float(counts[0]), 1.0))

    def sums(self, *parts: Any) -> torch.Tensor:
        """[loss, chosen rewards, rejected rewards, pairs ranked right] as one float64 vector."""
        total, chosen, rejected = parts
        return float64_sums(total, chosen.sum(), rejected.sum(), (chosen > rejected).sum())

    def fields(self, sums: Sequence[float], counts: Sequence[float]) -> dict[str, float | None]:
        """Mean loss, rewards, margin and accuracy over the pairs."""
        return pair_means(sums, float(counts[0]))
