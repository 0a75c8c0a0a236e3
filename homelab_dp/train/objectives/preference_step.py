"""The micro-step the preference objectives share (DPO, KTO, ORPO), and the backward (GRPO too).

Each preference objective reads its blocks of pairs (`train.objectives.pair_batch`) into its
own parts: the tensors its loss and its metric sums come from. The step is the same for all
three: the parts of the micro-batch, the loss scaled by the step's global units, one backward,
the detached metric sums; evaluation takes the same parts without a backward. What differs is
written by each objective: `PreferenceStep.parts`, `PreferenceStep.step_loss` and
`PreferenceStep.sums` (and `PreferenceStep.eval_parts` where evaluation differs, as KTO's KL
term).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from collections.abc import Sequence


def backward(loss: torch.Tensor, scaler: Any) -> None:
    """``loss.backward()``, through the fp16 GradScaler when there is one."""
    (scaler.scale(loss) if scaler is not None else loss).backward()


def float64_sums(*values: torch.Tensor) -> torch.Tensor:
    """Scalar tensors (detached) as one float64 vector: an objective's metric sums."""
    return torch.stack([v.detach().to(torch.float64) for v in values])


class PreferenceStep:
    """`train.objectives.objective.Objective`'s step for objectives on blocks of pairs."""

    def units(self, data: Any) -> torch.Tensor:
        """Per-block unit counts of the training data: `eval_units` of its pairs."""
        return self.eval_units(data.pairs)

    def eval_units(self, pairs: Any) -> torch.Tensor:
        """Per-block unit counts of ``pairs``, ``[n_blocks, U]`` float64."""
        raise NotImplementedError

    def begin_step(self, model: Any, data: Any, rank: Any, micro_idx: list[Any]) -> None:
        """Nothing to agree on before the micro-steps."""

    def parts(self, model: Any, pairs: Any, idx: torch.Tensor, device: Any) -> tuple[Any, ...]:
        """The tensors of the blocks ``idx`` the loss and the sums come from (with grad)."""
        raise NotImplementedError

    def eval_parts(self, model: Any, pairs: Any, idx: torch.Tensor, device: Any) -> tuple[Any, ...]:
        """The parts for evaluation: `parts` unless the objective says otherwise."""
        return self.parts(model, pairs, idx, device)

    def step_loss(
        self, parts: tuple[Any, ...], counts: Sequence[float], world: int
    ) -> torch.Tensor:
        """The micro-batch's loss, scaled by world / the step's global ``counts``."""
        raise NotImplementedError

    def sums(self, *parts: Any) -> torch.Tensor:
        """The metric sums (`metrics`, in order) of the parts, one float64 vector."""
        raise NotImplementedError

    def micro_step(
        self, model: Any, data: Any, idx: torch.Tensor, counts: Sequence[float], rank: Any,
        probe: Any = None, rows: Sequence[int] | None = None,
    ) -> torch.Tensor:  # fmt: skip
        """Forward, the loss scaled by the step's global counts, backward; the metric sums.
        ``rows`` (``idx`` as Python ints) is not needed here."""
        parts = self.parts(model, data.pairs, idx, rank.device)
        if probe is not None:
            probe.mark("forward")
        backward(self.step_loss(parts, counts, rank.world), model.scaler)
        if probe is not None:
            probe.mark("backward")
        return self.sums(*parts)

    def eval_sums(self, model: Any, pairs: Any, idx: torch.Tensor, device: Any) -> torch.Tensor:
        """The metric sums of the blocks ``idx`` without a backward (evaluation)."""
        return self.sums(*self.eval_parts(model, pairs, idx, device))
