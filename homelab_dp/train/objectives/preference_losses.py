"""Preference-tuning math as pure tensor functions: sequence log-probabilities, DPO, ORPO, KTO.

Every function takes per-sequence (or per-pair) tensors and returns per-pair (or per-completion)
tensors, so the objectives (``train/objectives/dpo.py`` and siblings) decide how they are summed
and scaled for exact data-parallel accumulation, and the pair evaluation reuses the same math.
The formulas are TRL's (``DPOTrainer.dpo_loss``, ``ORPOTrainer.odds_ratio_loss``,
``KTOTrainer.kto_loss``); tests/unit/train/test_preference_losses.py checks them against TRL on
the same log-probabilities.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
_LN2 = math.log(2.0)


def sequence_log_probs(
    logits: torch.Tensor,
    labels: torch.Tensor,
    sequence: torch.Tensor,
    n_sequences: int,
    *,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence id s in [0, n_sequences): the summed log-probability of its response tokens.

    ``sums[s] = Σ_t log softmax(logits[r, t])[labels[r, t]]`` over positions with
    ``labels != -100`` and ``sequence == s``; ``counts[s]`` is the number of those tokens.
    ``logits`` is [R, L, V]; ``labels`` and ``sequence`` are [R, L], already shifted (labels[r, t]
    is the target of position t) with sequence ids unique across the micro-batch (-1: padding).
    Only the target rows are cast to ``dtype`` (fp32, or fp64 when training in fp64) and
    normalised, so the [R, L, V] logits are never copied whole. Differentiable in ``logits``.
    """
    vocab = logits.shape[-1]
    labels = labels.to(logits.device)
    sequence = sequence.to(logits.device)
    keep = ((labels != IGNORE_INDEX) & (sequence >= 0)).reshape(-1)
    rows = keep.nonzero().squeeze(1)
    z = logits.reshape(-1, vocab).index_select(0, rows).to(dtype)
    targets = labels.reshape(-1).index_select(0, rows)
    seq_ids = sequence.reshape(-1).index_select(0, rows)
    token_logps = z.gather(1, targets[:, None]).squeeze(1) - torch.logsumexp(z, dim=1)
    sums = torch.zeros(n_sequences, dtype=dtype, device=logits.device)
    sums = sums.index_add(0, seq_ids, token_logps)
    counts = torch.bincount(seq_ids, minlength=n_sequences)[:n_sequences]
    return sums, counts


def dpo_loss(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair DPO losses and the chosen and rejected rewards (TRL's ``DPOTrainer.dpo_loss``).

    With ``h = (chosen - rejected) - (ref_chosen - ref_rejected)`` (policy minus reference
    log-ratio) and ε = ``label_smoothing``:

    - sigmoid: ``-(1 - ε)·log σ(β·h) - ε·log σ(-β·h)`` (conservative DPO when ε > 0);
    - ipo: ``(h - 1/(2β))²``; the caller passes length-averaged log-probabilities, as TRL does.

    Rewards are ``β·(chosen - ref_chosen)`` and ``β·(rejected - ref_rejected)``, detached.
    """
    logits = (chosen - rejected) - (ref_chosen - ref_rejected)
    if loss_type == "sigmoid":
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    elif loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss type {loss_type!r}")
    chosen_rewards = beta * (chosen - ref_chosen).detach()
    rejected_rewards = beta * (rejected - ref_rejected).detach()
    return losses, chosen_rewards, rejected_rewards


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """``log(1 - eˣ)`` for x < 0 without cancellation: expm1 near 0, log1p below -ln 2."""
    return torch.where(x < -_LN2, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss(
    chosen_avg: torch.Tensor, rejected_avg: torch.Tensor, *, orpo_lambda: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair ORPO odds-ratio term (to ADD to the chosen NLL) and the log odds ratio.

    From the length-averaged log-probabilities a = ``chosen_avg``, b = ``rejected_avg``:
    ``log_odds = (a - b) - (log(1 - eᵃ) - log(1 - eᵇ))`` and the term is
    ``-λ·log σ(log_odds)``, log(1 - eˣ) computed stably as TRL's ``log1mexp`` does. TRL's
    ``odds_ratio_loss`` returns ``λ·log σ(log_odds)`` and subtracts its mean from the NLL; the
    sign is folded in here so the objective adds.
    The log odds ratio is returned detached, for the step events.
    """
    log_odds = (chosen_avg - rejected_avg) - (_log1mexp(chosen_avg) - _log1mexp(rejected_avg))
    term = -orpo_lambda * F.logsigmoid(log_odds)
    return term, log_odds.detach()


def kto_loss(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | float,
    *,
    beta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-completion KTO losses and rewards (TRL's ``KTOTrainer.kto_loss``, unit weights).

    With ``r = logps - ref_logps`` and ``z = max(kl, 0)`` (the batch's KL estimate, detached:
    TRL clamps it at 0): a desirable completion costs ``1 - σ(β·(r - z))``, an undesirable one
    ``1 - σ(β·(z - r))``. Rewards are ``β·r``, detached. ``desirable`` is 1/0 (or bool) per
    completion; the losses keep the input order (TRL concatenates desirable then undesirable).
    """
    z = torch.as_tensor(kl, dtype=logps.dtype, device=logps.device).detach().clamp(min=0)
    logratios = logps - ref_logps
    want = desirable.to(device=logps.device).bool()
    losses = torch.where(
        want,
        1 - torch.sigmoid(beta * (logratios - z)),
        1 - torch.sigmoid(beta * (z - logratios)),
    )
    return losses, beta * logratios.detach()
