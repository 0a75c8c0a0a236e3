"""GRPO's math as pure tensor functions: advantages, clipped token losses, their normalisation.

The same losses as TRL's ``GRPOTrainer`` on the same log-probabilities and advantages
(tests/unit/train/test_grpo_losses.py checks each ``loss`` and ``scale_rewards`` against it):

- `advantages`: each completion's reward minus its group's mean (the ``generations``
  completions of one prompt), divided by the group's standard deviation (``group``), the whole
  batch's (``batch``), or not divided (``none``); the standard deviations are Bessel-corrected
  and get ``STD_EPS`` added, as TRL's.
- `token_losses`: the PPO-style clipped surrogate per completion token,
  ``−min(r·A, clip(r, 1 − ε, 1 + ε_high)·A)`` with the importance ratio ``r = exp(log π −
  log π_old)`` (1 with gradient when the generating policy is the one being trained:
  ``iterations = 1``), plus ``β·KL`` with the k3 estimator ``exp(ref − log π) − (ref − log π)
  − 1`` when β > 0; and which tokens were clipped (the ratio outside the range on the side the
  advantage pushes it).
- `loss_sum` and `loss_denominator`: the loss of a batch split so that any split of it (ranks,
  micro-batches) sums to the same thing: ``grpo`` sums each completion's mean token loss and
  divides by the completions; ``dr_grpo`` sums every token's loss and divides by completions ×
  ``max_completion_tokens``; ``dapo`` sums every token's loss and divides by the completion
  tokens of the whole batch. The loop divides each micro-batch's sum by the whole effective
  batch's denominator, so 1 and N processes give the same gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4
"""Added to the reward's standard deviation before dividing (TRL's constant)."""

LOSSES = ("grpo", "dr_grpo", "dapo")
SCALES = ("group", "batch", "none")


def advantages(rewards: torch.Tensor, generations: int, scale: str) -> torch.Tensor:
    """The advantage of each completion; ``rewards`` is ``[prompts × generations]``, the
    completions of one prompt next to each other."""
    if scale not in SCALES:
        raise ValueError(f"scale_rewards must be one of {SCALES}, got {scale!r}")
    groups = rewards.view(-1, generations)
    mean = groups.mean(1).repeat_interleave(generations)
    centred = rewards - mean
    if scale == "none":
        return centred
    if scale == "group":
        std = groups.std(1).repeat_interleave(generations)
    else:
        std = rewards.std().expand_as(rewards)
    return centred / (std + STD_EPS)


@dataclass
class TokenTerms:
    """`token_losses`: per completion token, ``[completions, T]``."""

    loss: torch.Tensor
    """The clipped surrogate (plus β·KL), with gradient through the policy's log-probs."""
    clipped: torch.Tensor
    """Bool: the ratio was clipped on the side the advantage pushes it."""
    kl: torch.Tensor | None
    """The k3 KL estimate to the reference (detached), None when β = 0."""


def token_losses(
    logps: torch.Tensor, advantage: torch.Tensor, *, old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None, epsilon: float, epsilon_high: float = 0.0,
    beta: float = 0.0,
) -> TokenTerms:  # fmt: skip
    """Per-token losses of completions with per-token log-probabilities ``logps``
    ``[completions, T]`` and one advantage per completion ``[completions]``.

    ``old_logps``: the generating policy's log-probabilities (None: this policy, detached, so
    the ratio is 1 with the policy gradient); ``ref_logps``: the reference's, needed when
    ``beta > 0``; ``epsilon_high`` 0 means ``epsilon``."""
    high = epsilon_high or epsilon
    old = logps.detach() if old_logps is None else old_logps
    ratio = torch.exp(logps - old)
    adv = advantage[:, None].to(logps.dtype)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + high)
    loss = -torch.min(ratio * adv, clipped_ratio * adv)
    clipped = ((ratio < 1 - epsilon) & (adv < 0)) | ((ratio > 1 + high) & (adv > 0))
    kl = None
    if beta != 0.0:
        if ref_logps is None:
            raise ValueError("beta > 0 needs the reference's log-probabilities")
        delta = ref_logps - logps
        k3 = torch.exp(delta) - delta - 1
        loss = loss + beta * k3
        kl = k3.detach()
    return TokenTerms(loss, clipped, kl)


def loss_sum(token_loss: torch.Tensor, mask: torch.Tensor, loss_type: str) -> torch.Tensor:
    """The numerator of the loss over these completions (``mask``: their completion tokens):
    grpo sums each completion's mean token loss, dr_grpo and dapo every token's loss."""
    m = mask.to(token_loss.dtype)
    if loss_type == "grpo":
        return ((token_loss * m).sum(-1) / m.sum(-1).clamp(min=1.0)).sum()
    if loss_type in ("dr_grpo", "dapo"):
        return (token_loss * m).sum()
    raise ValueError(f"loss must be one of {LOSSES}, got {loss_type!r}")


def loss_denominator(
    loss_type: str, completions: float, tokens: float, max_completion_tokens: int
) -> float:
    """What the whole batch's `loss_sum` is divided by: its completions (grpo), completions ×
    max_completion_tokens (dr_grpo), or its completion tokens (dapo; at least 1)."""
    if loss_type == "grpo":
        return max(float(completions), 1.0)
    if loss_type == "dr_grpo":
        return max(float(completions) * max_completion_tokens, 1.0)
    if loss_type == "dapo":
        return max(float(tokens), 1.0)
    raise ValueError(f"loss must be one of {LOSSES}, got {loss_type!r}")


def grpo_loss(
    logps: torch.Tensor, advantage: torch.Tensor, mask: torch.Tensor, *, loss_type: str,
    max_completion_tokens: int, epsilon: float, epsilon_high: float = 0.0, beta: float = 0.0,
    old_logps: torch.Tensor | None = None, ref_logps: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """The loss of one whole batch of completions (`token_losses`, `loss_sum` /
    `loss_denominator`)."""
    terms = token_losses(logps, advantage, old_logps=old_logps, ref_logps=ref_logps,
                         epsilon=epsilon, epsilon_high=epsilon_high, beta=beta)  # fmt: skip
    total = loss_sum(terms.loss, mask, loss_type)
    return total / loss_denominator(loss_type, mask.shape[0], float(mask.sum()),
                                    max_completion_tokens)  # fmt: skip


def masked_sum(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sum of ``values`` over the completion tokens (float64, detached): metric sums."""
    return (values.detach().to(torch.float64) * mask.to(torch.float64)).sum()
