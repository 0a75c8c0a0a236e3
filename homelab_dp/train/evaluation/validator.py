"""Validation while training: when to evaluate, the best eval loss, and early stopping.

The eval data (``data.eval_path`` or the held-out ``data.eval_fraction``, `homelab_dp.data.eval_split`)
is evaluated every ``train.eval_every`` optimizer steps and at the last step, on every rank
(`homelab_dp.train.evaluation.eval_loss.evaluate`: each rank a shard, the token-weighted sums all-reduced),
so every rank holds the same loss and takes the same decisions without another collective:
whether this is the best loss so far (``train.keep_best`` then keeps its checkpoint) and
whether the loss has gone ``train.early_stopping_patience`` evaluations without improving (the
run then ends as early_stopped: a completed run, result saved). The loop (`train.loop.training_loop`) acts on
the decisions; the state (best loss and step, evaluations since) travels in each checkpoint, so
a resumed run decides as an uninterrupted one would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from homelab_dp.runs.folder.heartbeats import EVALUATING
from homelab_dp.runs.run_events import EvalEvent
from homelab_dp.train.evaluation.eval_loss import PairEvalResult, evaluate, evaluate_pairs


@dataclass
class Verdict:
    """What one evaluation means for the run."""

    event: EvalEvent
    best: bool
    """The lowest eval loss so far (strictly lower than every earlier one)."""
    stop: bool
    """Early stopping: ``patience`` evaluations in a row without a new best."""


class Validator:
    """One rank's schedule of evaluations and its record of the best eval loss."""

    def __init__(
        self, blocks: Any, every: int, patience: int, *, objective: Any = None, pairs: Any = None
    ) -> None:
        self.blocks = blocks
        """`train.evaluation.eval_loss.EvalBlocks`: every rank holds all of them and evaluates its share."""
        self.objective = objective
        """With ``pairs``: the `train.objectives.objective.Objective` whose loss is evaluated."""
        self.pairs = pairs
        """Preference eval data (`train.objectives.pair_batch.PairData`), or None (SFT)."""
        self.every = every
        self.patience = patience
        self.best_loss: float | None = None
        self.best_step: int | None = None
        self.since_best = 0
        """Evaluations since the best one (early stopping ends the run at ``patience``)."""

    def due(self, step: int, total_steps: int) -> bool:
        """Evaluate after optimizer step ``step``: every ``every`` steps, and at the last."""
        return step == total_steps or (self.every > 0 and step % self.every == 0)

    def evaluate(self, step: int, model: torch.nn.Module, rank: Any, guard: Any) -> Any:
        """The eval loss of the model as trained for ``step`` steps (a collective: every rank
        calls it); every rank beats in the evaluating phase while it lasts, so a long eval is
        no stall for the watchdog."""

        with guard.beating(step, EVALUATING):
            if self.pairs is not None:
                return evaluate_pairs(model, self.pairs, self.objective, rank)
            return evaluate(
                model.strategy.model, self.blocks, rank=rank.rank, world=rank.world,
                micro=rank.micro, device=rank.device, autocast=model.autocast,
                loss_dtype=model.loss_dtype, loss_head=model.loss_head, flat=model.flat_batches,
                split=getattr(rank, "split", None),
            )  # fmt: skip

    def record(self, step: int, result: Any) -> Verdict:
        """Fold one evaluation's `EvalResult` in: the event to write and the decisions."""
        loss = float(result.loss)
        best = not math.isnan(loss) and (self.best_loss is None or loss < self.best_loss)
        if best:
            self.best_loss, self.best_step, self.since_best = loss, step, 0
        else:
            self.since_best += 1
        ppl = result.perplexity
        extra = (
            {"pairs": result.pairs, **result.fields} if isinstance(result, PairEvalResult) else {}
        )
        event = EvalEvent(step=step, loss=loss, perplexity=ppl if math.isfinite(ppl) else None,
                          tokens=int(result.tokens), seconds=float(result.seconds),
                          best=best, **extra)  # fmt: skip
        stop = self.patience > 0 and self.since_best >= self.patience
        return Verdict(event, best, stop)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (``trainer.json``'s ``eval``)."""
        return {"best_loss": self.best_loss, "best_step": self.best_step,
                "since_best": self.since_best}  # fmt: skip

    def restore(self, state: dict[str, Any] | None) -> None:
        """Take a checkpoint's `state` back (None: a checkpoint of a run without eval data)."""
        if state:
            self.best_loss = state.get("best_loss")
            self.best_step = state.get("best_step")
            self.since_best = int(state.get("since_best") or 0)
