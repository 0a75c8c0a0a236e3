"""A run that diverges ends with an error, never as a silent loop or a checkpoint of NaNs.

Three checks, each where the figure it reads is already on the host:

- **The loss** (`check_loss`): the token-weighted loss of a logged step, after the one
  all-gather that logging makes anyway (`train.loop.rank_stats.RankStats`). Every rank gets the same
  rows, so every rank ends at the same step. No other step reads it: checking every step would
  add a device sync to steps that have none.
- **The weights** (`require_finite_weights`): before a checkpoint is written, one flag per rank
  (every trainable tensor finite), all-reduced so every rank agrees; a checkpoint costs far more
  than this sync. The checkpoint of the last good step stays the newest on disk.
- **fp16 loss scaling** (`SkippedSteps`): torch's GradScaler skips a step whose gradients
  overflow and halves its scale; a residual stream that overflows in fp16 does so at every
  scale, and the run would loop forever without learning. `SKIP_LIMIT` consecutive skips end
  the run. A skip is read as the scale going down across ``update()`` (the scale grows only
  after ``growth_interval`` clean steps and shrinks only on a skip), between two
  ``get_scale()`` calls after ``scaler.step``, which has already synced on the overflow flag.

Each ends the run with `NonFiniteError` (exit 1, an ``error`` event naming the step, the
figure and the fix; the run's state becomes failed); its last good checkpoint is kept.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from homelab_dp.errors import RunFailedError

SKIP_LIMIT = 20
"""Consecutive optimizer steps the fp16 GradScaler may skip before the run ends. With the
default backoff (halve the scale per skip) from 2**16, 20 skips take the scale below 2**-3:
gradients that still overflow there overflow at any scale (the forward itself does)."""

FP16_HINT = (
    "train in bf16 on a card of compute capability 8.0 (Ampere) or newer, keep norms and "
    "embeddings in fp32 (LoRA and QLoRA do under fp16), or lower train.lr"
)


class NonFiniteError(RunFailedError):
    """The loss, the weights or fp16's scaled gradients stopped being finite numbers."""


def check_loss(loss: float, step: int, *, lr: float, dtype: str) -> None:
    """Raise `NonFiniteError` when the logged loss of optimizer step ``step`` is inf or NaN."""
    if math.isfinite(loss):
        return
    if dtype == "fp16":
        hint = f"fp16 overflow: {FP16_HINT} (now {lr:g})"
    else:
        hint = f"lower train.lr (now {lr:g}) or set train.max_grad_norm, and run again"
    raise NonFiniteError(
        f"training diverged: the loss of step {step} is {loss} (not a finite number); the run "
        "ends here and keeps its last checkpoint written before it",
        hint=hint,
    )


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor itself."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def weights_finite(model: nn.Module, device: torch.device | None = None) -> bool:
    """Whether every trainable parameter of ``model`` is finite on every rank (one all-reduce
    when a process group is up; ``device``: where the flag travels, the ranks' device)."""
    import torch.distributed as dist

    params = [_local(p.detach()) for p in model.parameters() if p.requires_grad]
    where = torch.device("cpu") if device is None else torch.device(device)
    # One flag per tensor on the device it lives on, stacked where the flag travels: no sync
    # until the all-reduce's result is read.
    flags = [torch.isfinite(p).all().to(where) for p in params]
    ok = torch.stack(flags).all() if flags else torch.tensor(True, device=where)
    flag = ok.to(torch.int32)
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def require_finite_weights(model: nn.Module, step: int, device: torch.device | None = None) -> None:
    """Raise `NonFiniteError` instead of checkpointing non-finite weights after ``step``."""
    if weights_finite(model, device):
        return
    raise NonFiniteError(
        f"training diverged: the weights after step {step} are not finite (inf or NaN); no "
        "checkpoint of them is written, the last one before it is kept",
        hint="lower train.lr or set train.max_grad_norm, and run again",
    )


class SkippedSteps:
    """Counts the GradScaler's consecutive skipped steps; `SKIP_LIMIT` of them end the run."""

    def __init__(self, limit: int = SKIP_LIMIT) -> None:
        self.limit = limit
        self.consecutive = 0
        """Skipped steps in a row, up to the last one observed."""
        self.total = 0

    def observe(self, scale_before: float, scale_after: float, step: int) -> bool:
        """Record one optimizer step from the scale before and after ``scaler.update()``;
        whether it was skipped. Raises `NonFiniteError` at the limit."""
        skipped = scale_after < scale_before
        self.consecutive = self.consecutive + 1 if skipped else 0
        self.total += skipped
        if self.consecutive >= self.limit:
            raise NonFiniteError(
                f"fp16 overflow: the gradient scaler skipped {self.consecutive} optimizer steps "
                f"in a row up to step {step} (gradients inf or NaN at every loss scale, down to "
                f"{scale_after:g}); the weights have not changed since, and the run ends",
                hint=FP16_HINT,
            )
        return skipped

    def step(
        self, scaler: torch.amp.GradScaler | None, optimizer: torch.optim.Optimizer, step: int
    ) -> bool:
        """``scaler.step(optimizer)`` and ``scaler.update()``, observed; whether it skipped."""
        scaler.step(optimizer)
        before = float(scaler.get_scale())
        scaler.update()
        return self.observe(before, float(scaler.get_scale()), step)
