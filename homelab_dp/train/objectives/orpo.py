"""ORPO: the chosen answer's NLL plus an odds-ratio term; no reference model.

Two units: the chosen answers' target tokens (the NLL is a mean per target token over the
whole effective batch, as SFT's loss) and the pairs (the odds-ratio term is a mean over the
pairs). Each micro-batch adds ``world · (NLL sum / chosen tokens + term sum / pairs)`` of the
step's global counts, so the gradient is the effective batch's whatever the split. The term
is `train.objectives.preference_losses.orpo_loss` on length-averaged log-probabilities (TRL's
``odds_ratio_loss``). Events: loss, nll, log_odds_ratio.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from homelab_dp.train.objectives.dpo import backward
from homelab_dp.train.objectives.pair_batch import batch_of, forward_logps
from homelab_dp.train.objectives.preference_losses import orpo_loss

if TYPE_CHECKING:
    from collections.abc import Sequence


class OrpoObjective:
    """`train.objectives.objective.Objective` of ORPO (see the module docstring)."""

    name = "orpo"
    metrics = ("nll_sum", "odds_ratio_term_sum", "log_odds_ratio_sum")

    def __init__(self, orpo_lambda: float) -> None:
        self.orpo_lambda = orpo_lambda

    def units(self, data: Any) -> torch.Tensor:
        """``[n_blocks, 2]``: pairs, chosen target tokens."""
        return self.eval_units(data.pairs)

    def eval_units(self, pairs: Any) -> torch.Tensor:
        """Pairs and chosen target tokens per block of ``pairs``."""
        return torch.stack([pairs.n_pairs, pairs.chosen_targets()], 1).to(torch.float64)

    def begin_step(self, model: Any, data: Any, rank: Any, micro_idx: list[Any]) -> None:
        """Nothing to agree on before the micro-steps."""

    def parts(
        self, model: Any, pairs: Any, idx: torch.Tensor, device: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(chosen NLL sum, per-pair odds-ratio terms, per-pair log odds ratios) of ``idx``."""
        batch = batch_of(pairs, idx, device, flat=model.flat_batches)
        logps, counts = forward_logps(model.strategy.model, batch, autocast=model.autocast,
                                      dtype=model.loss_dtype)  # fmt: skip
        avg = logps / counts.clamp(min=1).to(logps.dtype)
        term, log_odds = orpo_loss(avg[0::2], avg[1::2], orpo_lambda=self.orpo_lambda)
        return -logps[0::2].sum(), term, log_odds

    def micro_step(
        self, model: Any, data: Any, idx: torch.Tensor, counts: Sequence[float], rank: Any,
        probe: Any = None, rows: Sequence[int] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Forward, NLL per chosen token + the mean odds-ratio term (global counts), backward."""
        nll, term, log_odds = self.parts(model, data.pairs, idx, rank.device)
        if probe is not None:
            probe.mark("forward")
        pairs, tokens = max(float(counts[0]), 1.0), max(float(counts[1]), 1.0)
        backward(rank.world * (nll / tokens + term.sum() / pairs), model.scaler)
        if probe is not None:
            probe.mark("backward")
        return _sums(nll, term, log_odds)

    def eval_sums(self, model: Any, pairs: Any, idx: torch.Tensor, device: Any) -> torch.Tensor:
        """The metric sums of the blocks ``idx`` without a backward (evaluation)."""
        return _sums(*self.parts(model, pairs, idx, device))

    def fields(self, sums: Sequence[float], counts: Sequence[float]) -> dict[str, float | None]:
        """Loss = NLL per chosen token + mean odds-ratio term; nll; mean log odds ratio."""
        pairs, tokens = float(counts[0]), float(counts[1])
        if not pairs or not tokens:
            return {"loss": float("nan")}
        nll = sums[0] / tokens
        return {"loss": nll + sums[1] / pairs, "nll": nll, "log_odds_ratio": sums[2] / pairs}


def _sums(nll: torch.Tensor, term: torch.Tensor, log_odds: torch.Tensor) -> torch.Tensor:
    return torch.stack([nll.detach().to(torch.float64), term.detach().sum().to(torch.float64),
                        log_odds.sum().to(torch.float64)])  # fmt: skip
