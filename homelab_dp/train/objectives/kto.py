"""KTO: completions labelled desirable or not, against a reference model and a batch KL.

The unit is the completion: the step's loss is the mean per-completion loss over the effective
batch (`train.objectives.preference_losses.kto_loss`, TRL's ``KTOTrainer.kto_loss`` with unit
weights). Each block's sequence 2k is completion k, 2k+1 its mismatched "KL" completion (the
same prompt with another record's completion, fixed when the data was prepared). The KL
estimate z = mean over the effective batch's KL completions of (policy − reference)
log-probability, clamped at 0 and detached, is computed before the step's first micro-step:
a no-grad forward of this rank's micro-batches and one all-reduce of [sum, count], so it is
the same on every rank and for any split. Events: loss, rewards_chosen (desirable),
rewards_rejected (undesirable), reward_margin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from homelab_dp.train.objectives.dpo import backward
from homelab_dp.train.objectives.pair_batch import batch_of, forward_logps
from homelab_dp.train.objectives.preference_losses import kto_loss

if TYPE_CHECKING:
    from collections.abc import Sequence


class KtoObjective:
    """`train.objectives.objective.Objective` of KTO (see the module docstring)."""

    name = "kto"
    metrics = ("loss_sum", "desirable_rewards_sum", "undesirable_rewards_sum")

    def __init__(self, reference: Any, *, beta: float) -> None:
        self.reference = reference
        self.beta = beta
        self.kl = 0.0
        """The step's KL estimate (`begin_step`)."""

    def units(self, data: Any) -> torch.Tensor:
        """``[n_blocks, 3]``: completions, desirable ones, undesirable ones."""
        return self.eval_units(data.pairs)

    def eval_units(self, pairs: Any) -> torch.Tensor:
        """Completions, desirable and undesirable completions per block of ``pairs``."""
        good = (pairs.desirable == 1).sum(1)
        bad = (pairs.desirable == 0).sum(1)
        return torch.stack([pairs.n_pairs, good, bad], 1).to(torch.float64)

    def kl_estimate(self, model: Any, pairs: Any, micro_idx: list[Any], rank: Any) -> float:
        """z over every rank's ``micro_idx`` blocks (a collective: every rank calls it)."""
        total = torch.zeros(2, dtype=torch.float64, device=rank.device)
        with torch.no_grad():
            for idx in micro_idx:
                batch = batch_of(pairs, idx, rank.device, flat=model.flat_batches)
                ref = self.reference.logps(model, pairs, batch)
                logps, _ = forward_logps(model.strategy.inner, batch, autocast=model.autocast,
                                         dtype=model.loss_dtype)  # fmt: skip
                total[0] += (logps[1::2] - ref[1::2]).sum().to(torch.float64)
                total[1] += batch.n_sequences // 2
        if rank.world > 1:
            import torch.distributed as dist

            dist.all_reduce(total)
        return max(float(total[0] / total[1]), 0.0) if float(total[1]) else 0.0

    def begin_step(self, model: Any, data: Any, rank: Any, micro_idx: list[Any]) -> None:
        """The step's KL estimate over the whole effective batch."""
        self.kl = self.kl_estimate(model, data.pairs, micro_idx, rank)

    def parts(
        self, model: Any, pairs: Any, idx: torch.Tensor, device: Any, kl: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(per-completion losses, rewards, desirable flags) of the blocks ``idx``."""
        batch = batch_of(pairs, idx, device, flat=model.flat_batches)
        ref = self.reference.logps(model, pairs, batch)
        logps, _ = forward_logps(model.strategy.model, batch, autocast=model.autocast,
                                 dtype=model.loss_dtype)  # fmt: skip
        want = batch.desirable.to(device)
        losses, rewards = kto_loss(logps[0::2], ref[0::2], want, kl, beta=self.beta)
        return losses, rewards, want

    def micro_step(
        self, model: Any, data: Any, idx: torch.Tensor, counts: Sequence[float], rank: Any,
        probe: Any = None, rows: Sequence[int] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Forward, the loss scaled by world / the step's completions, backward."""
        losses, rewards, want = self.parts(model, data.pairs, idx, rank.device, self.kl)
        if probe is not None:
            probe.mark("forward")
        total = losses.sum()
        backward(total * (rank.world / max(float(counts[0]), 1.0)), model.scaler)
        if probe is not None:
            probe.mark("backward")
        return _sums(total, rewards, want)

    def eval_sums(self, model: Any, pairs: Any, idx: torch.Tensor, device: Any) -> torch.Tensor:
        """The metric sums of ``idx`` (the KL term taken as 0: no batch to estimate it on)."""
        return _sums(*self.parts(model, pairs, idx, device, 0.0))

    def fields(self, sums: Sequence[float], counts: Sequence[float]) -> dict[str, float | None]:
        """Mean loss; mean desirable and undesirable rewards and their difference."""
        n, good, bad = (float(c) for c in counts[:3])
        if not n:
            return {"loss": float("nan")}
        chosen = sums[1] / good if good else None
        rejected = sums[2] / bad if bad else None
        margin = chosen - rejected if chosen is not None and rejected is not None else None
        return {"loss": sums[0] / n, "rewards_chosen": chosen, "rewards_rejected": rejected,
                "reward_margin": margin}  # fmt: skip


def _sums(total: torch.Tensor, rewards: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    good = want.bool()
    return torch.stack([total.detach().to(torch.float64),
                        rewards[good].sum().to(torch.float64),
                        rewards[~good].sum().to(torch.float64)])  # fmt: skip
