"""The evaluation routine (train.evaluate) against a direct transformers computation."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from homelab_dp.data.blocks import build_blocks, tokenize_records
from homelab_dp.data.samples import read_with_lines
from homelab_dp.train.evaluation.eval_loss import eval_blocks, evaluate, rank_batches
from homelab_dp.train.model.loss import install_loss_head
from tests.integration.conftest import DEMO_DATA, DEMO_MODEL


def test_every_rank_gets_the_same_number_of_batches_and_each_block_once() -> None:
    for n in (1, 5, 8, 13):
        for world in (1, 2, 3):
            for micro in (1, 2, 4):
                per_rank = [rank_batches(n, r, world, micro) for r in range(world)]
                assert len({len(b) for b in per_rank}) == 1
                seen = sorted(i for batches in per_rank for b in batches for i in b)
                assert seen == list(range(n))


def _direct(model: torch.nn.Module, blocks: list) -> tuple[float, int]:
    """Sum of token losses, one unpadded sample at a time, with transformers' own shift."""
    total, count = 0.0, 0
    for b in blocks:
        n = sum(b.attention_mask)
        ids = torch.tensor([b.input_ids[:n]])
        labels = torch.tensor([b.labels[:n]])
        logits = model(input_ids=ids).logits.double()
        total += float(torch.nn.functional.cross_entropy(
            logits[0], labels[0], ignore_index=-100, reduction="sum"))  # fmt: skip
        count += int((labels != -100).sum())
    return total, count


@pytest.mark.parametrize("pack", [False, True])
@pytest.mark.parametrize("chunked", [False, True])
def test_loss_equals_a_direct_computation(pack: bool, chunked: bool) -> None:
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float64)
    records, lines, fmt = read_with_lines(DEMO_DATA, "auto")
    examples = tokenize_records(records[:20], fmt, tokenizer, where=[str(n) for n in lines[:20]])
    single = build_blocks(examples, 64, False, int(tokenizer.pad_token_id or 0), split=False)
    blocks = build_blocks(examples, 64, pack, int(tokenizer.pad_token_id or 0), split=False)
    with torch.no_grad():
        want_sum, want_tokens = _direct(model, single)
    head = install_loss_head(model) if chunked else None
    model.train()
    got = evaluate(model, eval_blocks(blocks, pack), rank=0, world=1, micro=3,
                   device=torch.device("cpu"), loss_dtype=torch.float64, loss_head=head)  # fmt: skip
    assert got.tokens == want_tokens
    assert got.loss == pytest.approx(want_sum / want_tokens, rel=1e-9)
    assert got.perplexity == pytest.approx(math.exp(want_sum / want_tokens), rel=1e-9)
    assert model.training  # evaluated in eval mode, handed back in the mode it came in
