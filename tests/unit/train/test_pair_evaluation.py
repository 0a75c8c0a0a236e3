"""The pair eval worker's sums in one process: a LoRA model against its base (adapters disabled)
equals a direct computation, one sequence at a time, for the sigmoid and IPO losses; how the
pairs are cut into micro-batches does not change the sums."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from homelab_dp.data.preference_blocks import pair_blocks_of
from homelab_dp.data.samples import load_pairs
from homelab_dp.presets.preset import DataSection
from homelab_dp.train.evaluation.pair_evaluation import evaluate_pairs, pair_tensors
from tests.conftest import ROOT

TINY = ROOT / "assets" / "models" / "tiny-llama"
PAIRS = ROOT / "assets" / "data" / "tiny-preferences.jsonl"
SEQ_LEN = 32
N = 7
BETA = 0.2


@pytest.fixture(scope="module")
def lora_model() -> Any:
    """The tiny model with a LoRA adapter whose B matrices are random (it changes the output)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.05
    return model.eval()


@pytest.fixture(scope="module")
def pairs() -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY)
    data = DataSection(path=str(PAIRS), format="preference", seq_len=SEQ_LEN, pack=False)
    loaded = load_pairs(data, tokenizer, objective="dpo", seq_len_limit=None)
    blocks, _ = pair_blocks_of(loaded.pairs[:N], data, loaded.fmt, loaded.pad_id, seed=0,
                               where="test", min_blocks=1)  # fmt: skip
    return loaded.pairs[:N], pair_tensors(blocks)


@pytest.fixture(scope="module")
def direct_log_probs(lora_model: Any, pairs: Any) -> list[tuple[float, ...]]:
    """Per pair, each sequence alone, fp64 sums: (policy chosen, policy rejected, reference
    chosen, reference rejected, chosen tokens, rejected tokens); the reference is the policy
    with its adapters disabled."""
    model, (examples, _) = lora_model, pairs

    def logp(prompt: list[int], response: list[int]) -> tuple[float, int]:
        ids = (prompt + response)[: SEQ_LEN + 1]
        logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0].double()
        lp = torch.log_softmax(logits, dim=-1)
        steps = range(len(prompt) - 1, len(ids) - 1)
        return sum(float(lp[t, ids[t + 1]]) for t in steps), len(steps)

    out = []
    with torch.no_grad():
        for ex in examples:
            (pc, nc), (pr, nr) = logp(ex.prompt, ex.chosen), logp(ex.prompt, ex.rejected)
            with model.disable_adapter():
                (rc, _), (rr, _) = logp(ex.prompt, ex.chosen), logp(ex.prompt, ex.rejected)
            out.append((pc, pr, rc, rr, nc, nr))
    return out


def _direct(log_probs: list[tuple[float, ...]], loss_type: str) -> dict[str, float]:
    """The summed loss, rewards and wins of the module docstring's direct computation."""
    out = {"loss": 0.0, "chosen": 0.0, "rejected": 0.0, "correct": 0.0}
    for pc, pr, rc, rr, nc, nr in log_probs:
        if loss_type == "ipo":  # length-averaged, as TRL's IPO
            pc, rc, pr, rr = pc / nc, rc / nc, pr / nr, rr / nr
        h = (pc - pr) - (rc - rr)
        ipo = loss_type == "ipo"
        out["loss"] += (h - 1 / (2 * BETA)) ** 2 if ipo else math.log1p(math.exp(-BETA * h))
        out["chosen"] += BETA * (pc - rc)
        out["rejected"] += BETA * (pr - rr)
        out["correct"] += float(pc - rc > pr - rr)
    return out


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_lora_against_its_base_equals_the_direct_computation(
    lora_model, pairs, direct_log_probs, loss_type
):
    _, tensors = pairs
    want = _direct(direct_log_probs, loss_type)
    sums = [
        evaluate_pairs(lora_model, None, tensors, rank=0, world=1, micro=micro,
                       device=torch.device("cpu"), beta=BETA, loss_type=loss_type,
                       label_smoothing=0.0)
        for micro in (1, 3)
    ]  # fmt: skip
    for s in sums:
        assert s.pairs == N
        # fp32 logits, batched with padding here and one sequence alone there, each attention
        # kernel summing in its own order: the eval CLI's tolerance (rel 1e-5)
        assert s.loss == pytest.approx(want["loss"], rel=1e-5, abs=1e-6)
        assert s.chosen_rewards == pytest.approx(want["chosen"], rel=1e-5, abs=1e-6)
        assert s.rejected_rewards == pytest.approx(want["rejected"], rel=1e-5, abs=1e-6)
        assert s.correct == want["correct"]
    assert 0 < want["correct"] < N  # both kinds of pair: the accuracy is a real count
    means = sums[0].means()
    assert means["reward_margin"] == pytest.approx(
        (want["chosen"] - want["rejected"]) / N, abs=1e-6
    )
