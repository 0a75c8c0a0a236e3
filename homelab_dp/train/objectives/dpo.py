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

if TYPE_CHECKING:
    from collections.abc import Sequence


def backward(loss: torch.Tensor, scaler: Any) -> None:
    """``loss.backward()``, through the fp16 GradScaler when there is one."""
    (scaler.scale(loss) if scaler is not None else loss).backward()


def pair_means(sums: Sequence[float], pairs: float) -> dict[str, float | None]:
    """DPO's event fields from [loss, chosen rewards, rejected rewards, right] sums."""
    if not pairs:
        return {"loss": float("nan")}
    return {
        "loss": sums[0] / pairs, "rewards_chosen": sums[1] / pairs,
        "rewards_rejected": sums[2] / pairs, "reward_margin": (sums[1] - sums[2]) / pairs,
        "reward_accuracy": sums[3] / pairs,
    }  # fmt: skip


class DpoObjective:
    """`train.objectives.objective.Objective` of DPO (see the module docstring)."""

    name = "dpo"
    metrics = ("loss_sum", "rewards_chosen_sum", "rewards_rejected_sum", "right_pairs")

    def __init__(self, reference: Any, *, beta: float, loss_type: str, label_smoothing: float):
        self.reference = reference
        """`train.objectives.reference`: AdapterReference, PrecomputedReference or CopyReference."""
        self.beta, self.loss_type, self.label_smoothing = beta, loss_type, label_smoothing

    def units(self, data: Any) -> torch.Tensor:
        """Pairs per block, ``[n_blocks, 1]``."""
        return data.pairs.n_pairs.to(torch.float64)[:, None]

    def begin_step(self, model: Any, data: Any, rank: Any, micro_idx: list[Any]) -> None:
        """Nothing to agree on before the micro-steps."""

    def pair_losses(
        self, model: Any, pairs: Any, idx: torch.Tensor, device: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-pair losses (with grad when enabled), chosen and rejected rewards of ``idx``."""
        batch = batch_of(pairs, idx, device, flat=model.flat_batches)
        ref = self.reference.logps(model, pairs, batch)
        logps, counts = forward_logps(model.strategy.model, batch, autocast=model.autocast,
                                      dtype=model.loss_dtype)  # fmt: skip
        if self.loss_type == "ipo":  # length-averaged, as TRL's IPO
            n = counts.clamp(min=1).to(logps.dtype)
            logps, ref = logps / n, ref / n
        return dpo_loss(logps[0::2], logps[1::2], ref[0::2], ref[1::2], beta=self.beta,
                        loss_type=self.loss_type, label_smoothing=self.label_smoothing)  # fmt: skip

    def micro_step(
        self, model: Any, data: Any, idx: torch.Tensor, counts: Sequence[float], rank: Any,
        probe: Any = None, rows: Sequence[int] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Forward, the loss scaled by world / the step's pairs, backward; the metric sums."""
        losses, chosen, rejected = self.pair_losses(model, data.pairs, idx, rank.device)
        if probe is not None:
            probe.mark("forward")
        total = losses.sum()
        backward(total * (rank.world / max(float(counts[0]), 1.0)), model.scaler)
        if probe is not None:
            probe.mark("backward")
        return pair_sums(total, chosen, rejected)

    def eval_sums(self, model: Any, pairs: Any, idx: torch.Tensor, device: Any) -> torch.Tensor:
        """The metric sums of the blocks ``idx`` without a backward (evaluation)."""
        losses, chosen, rejected = self.pair_losses(model, pairs, idx, device)
        return pair_sums(losses.sum(), chosen, rejected)

    def eval_units(self, pairs: Any) -> torch.Tensor:
        """Pairs per block of eval data."""
        return pairs.n_pairs.to(torch.float64)[:, None]

    def fields(self, sums: Sequence[float], counts: Sequence[float]) -> dict[str, float | None]:
        """Mean loss, rewards, margin and accuracy over the pairs."""
        return pair_means(sums, float(counts[0]))


def pair_sums(total: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """[loss, chosen rewards, rejected rewards, pairs ranked right] as one float64 vector."""
    return torch.stack([total.detach().to(torch.float64), chosen.sum().to(torch.float64),
                        rejected.sum().to(torch.float64),
                        (chosen > rejected).sum().to(torch.float64)])  # fmt: skip
