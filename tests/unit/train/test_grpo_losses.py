"""GRPO's losses and advantages against TRL's ``GRPOTrainer`` (1.16) on the same numbers.

The loss: TRL's ``_compute_loss`` is called with a minimal stand-in for its ``self`` (its
settings, an accelerator of one process) whose ``_get_per_token_logps_and_entropies`` returns
the test's log-probabilities, so TRL's own code clips, adds the KL and normalises; the loss,
its gradient with respect to the log-probabilities, the clipped share and the KL are compared
for each ``loss`` (grpo, dr_grpo, dapo), with and without β and an old policy.

The advantages: TRL computes them inline in ``_generate_and_score_completions``; the test runs
TRL's own lines of that method (its ``sum_then_normalize`` branch, taken from its source) on the
test's rewards, for each ``scale_rewards``.
"""

from __future__ import annotations

import inspect
import textwrap
import types
from collections import defaultdict

import pytest
import torch
from trl import GRPOTrainer
from trl.trainer.utils import nanstd

from homelab_dp.train.objectives.grpo_losses import (
    advantages,
    grpo_loss,
    loss_denominator,
    loss_sum,
    masked_sum,
    token_losses,
)

PROMPTS, G, T = 3, 4, 7
MAX_COMPLETION = 9


class _OneProcess:
    """TRL's ``self.accelerator`` for one process."""

    device = torch.device("cpu")
    num_processes = 1

    @staticmethod
    def gather(t: torch.Tensor) -> torch.Tensor:
        return t

    gather_for_metrics = gather

    @staticmethod
    def reduce(t: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return t


def _batch(seed: int) -> dict[str, torch.Tensor]:
    """Log-probabilities of the policy, the old policy and the reference, a completion mask of
    different lengths (one completion empty but one token), advantages of both signs."""
    g = torch.Generator().manual_seed(seed)
    n = PROMPTS * G
    logps = -torch.rand(n, T, generator=g, dtype=torch.float64) * 3
    old = logps + torch.randn(n, T, generator=g, dtype=torch.float64) * 0.4  # ratios well past ε
    ref = logps + torch.randn(n, T, generator=g, dtype=torch.float64) * 0.3
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    return {"logps": logps, "old": old, "ref": ref, "mask": mask, "adv": adv}


def _trl_loss(b: dict, logps: torch.Tensor, *, loss_type: str, beta: float, eps: float,
              eps_high: float, old: bool) -> tuple[torch.Tensor, dict]:  # fmt: skip
    """TRL's ``_compute_loss`` on these numbers; the loss and TRL's logged metrics."""
    n = logps.shape[0]
    me = types.SimpleNamespace(
        model=types.SimpleNamespace(training=True), accelerator=_OneProcess(),
        top_entropy_quantile=1.0, off_policy_mask_threshold=None, importance_sampling_level="token",
        beta=beta, loss_type=loss_type, epsilon_low=eps, epsilon_high=eps_high, use_vllm=False,
        vllm_importance_sampling_correction=False, current_gradient_accumulation_steps=1,
        max_completion_length=MAX_COMPLETION, aux_loss_enabled=False, _entropy_bonus_enabled=False,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None,
                                   steps_per_generation=1),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
    )  # fmt: skip
    inputs = {
        "prompt_ids": torch.zeros(n, 2, dtype=torch.long), "prompt_mask": torch.ones(n, 2),
        "completion_ids": torch.zeros(n, T, dtype=torch.long), "completion_mask": b["mask"],
        "advantages": b["adv"], "num_items_in_batch": b["mask"].sum(),
    }  # fmt: skip
    if old:
        inputs["old_per_token_logps"] = b["old"]
    if beta:
        inputs["ref_per_token_logps"] = b["ref"]
    loss = GRPOTrainer._compute_loss(me, None, inputs)
    return loss, me._metrics["train"]


CASES = [(loss, beta, old, high) for loss in ("grpo", "dr_grpo", "dapo")
         for beta, old, high in ((0.0, False, 0.0), (0.04, True, 0.0), (0.1, True, 0.28))]  # fmt: skip


@pytest.mark.parametrize(("loss_type", "beta", "old", "eps_high"), CASES)
def test_the_loss_and_its_gradient_equal_trls(
    loss_type: str, beta: float, old: bool, eps_high: float
) -> None:
    b = _batch(seed=7)
    eps = 0.2
    mine = b["logps"].clone().requires_grad_(True)
    ours = grpo_loss(mine, b["adv"], b["mask"], loss_type=loss_type,
                     max_completion_tokens=MAX_COMPLETION, epsilon=eps, epsilon_high=eps_high,
                     beta=beta, old_logps=b["old"] if old else None,
                     ref_logps=b["ref"] if beta else None)  # fmt: skip
    theirs_in = b["logps"].clone().requires_grad_(True)
    theirs, metrics = _trl_loss(b, theirs_in, loss_type=loss_type, beta=beta, eps=eps,
                                eps_high=eps_high or eps, old=old)  # fmt: skip
    ours.backward()
    theirs.backward()
    assert float(ours) == pytest.approx(float(theirs), rel=1e-12, abs=1e-14)
    torch.testing.assert_close(mine.grad, theirs_in.grad, rtol=1e-12, atol=1e-14)
    terms = token_losses(b["logps"], b["adv"], old_logps=b["old"] if old else None,
                         ref_logps=b["ref"] if beta else None, epsilon=eps,
                         epsilon_high=eps_high, beta=beta)  # fmt: skip
    tokens = float(b["mask"].sum())
    clipped = float(masked_sum(terms.clipped.double(), b["mask"])) / tokens
    # TRL logs its metrics in float32 (its token count is cast to float)
    assert clipped == pytest.approx(metrics["clip_ratio/region_mean"][0], rel=1e-6)
    if old:  # the old policy is far enough off that some tokens are clipped
        assert clipped > 0
    if beta:
        assert terms.kl is not None
        kl = float(masked_sum(terms.kl, b["mask"])) / tokens
        assert kl == pytest.approx(metrics["kl"][0], rel=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_any_split_of_the_batch_sums_to_the_whole_batchs_loss(loss_type: str) -> None:
    """What makes 1 = N processes: each part's `loss_sum` over the whole batch's denominator."""
    b = _batch(seed=3)
    whole = grpo_loss(b["logps"], b["adv"], b["mask"], loss_type=loss_type,
                      max_completion_tokens=MAX_COMPLETION, epsilon=0.2, old_logps=b["old"])  # fmt: skip
    den = loss_denominator(loss_type, b["mask"].shape[0], float(b["mask"].sum()), MAX_COMPLETION)
    parts = 0.0
    for rows in (slice(0, 5), slice(5, 8), slice(8, None)):
        terms = token_losses(b["logps"][rows], b["adv"][rows], old_logps=b["old"][rows],
                             epsilon=0.2)  # fmt: skip
        parts += float(loss_sum(terms.loss, b["mask"][rows], loss_type)) / den
    assert parts == pytest.approx(float(whole), rel=1e-12)


def _trl_advantages(rewards_per_func: torch.Tensor, weights: torch.Tensor, scale: str,
                    generations: int) -> torch.Tensor:  # fmt: skip
    """TRL's own advantage lines (the ``sum_then_normalize`` branch of
    ``_generate_and_score_completions``) run on these rewards."""
    source = textwrap.dedent(inspect.getsource(GRPOTrainer._generate_and_score_completions))
    start = source.index('if self.multi_objective_aggregation == "sum_then_normalize":')
    end = source.index('elif self.multi_objective_aggregation == "normalize_then_sum":')
    block = textwrap.dedent("\n".join(source[start:end].splitlines()[1:]))
    scope = {
        "self": types.SimpleNamespace(reward_weights=weights, scale_rewards=scale),
        "rewards_per_func": rewards_per_func, "device": torch.device("cpu"),
        "num_generations": generations, "torch": torch, "nanstd": nanstd,
        "unscorable_mask": torch.isnan(rewards_per_func).all(dim=1),
    }  # fmt: skip
    exec(compile(block, "trl-advantages", "exec"), scope)  # noqa: S102 - TRL's own lines
    return scope["advantages"]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_the_advantages_equal_trls(scale: str) -> None:
    g = torch.Generator().manual_seed(11)
    per_func = torch.rand(PROMPTS * G, 2, generator=g, dtype=torch.float64)
    per_func[G : 2 * G, 0] = 1.0  # a group whose first reward is the same for every completion
    weights = torch.tensor([1.0, 0.25], dtype=torch.float64)
    total = (per_func * weights).sum(1)
    ours = advantages(total, G, scale)
    theirs = _trl_advantages(per_func, weights, scale, G)
    # TRL's Bessel correction count / (count - 1) is a float32 division of integer counts
    torch.testing.assert_close(ours, theirs, rtol=1e-7, atol=1e-9)
    groups = ours.view(PROMPTS, G)
    assert torch.allclose(groups.sum(1), torch.zeros(PROMPTS, dtype=torch.float64), atol=1e-9)
    if scale == "none":
        assert torch.allclose(ours, total - total.view(PROMPTS, G).mean(1).repeat_interleave(G))
