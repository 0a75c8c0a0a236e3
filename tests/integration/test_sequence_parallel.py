"""Sequence parallelism (issue 38, item 3): every sequence split over 2 ranks trains exactly as
one rank with the whole sequence.

One rank without the split and 2 ranks with ``train.sequence_parallel = 2`` train the same tiny
model (4 query heads, 1 key/value head: the key/value head is repeated for the split) on the
same packed blocks of 2,048 tokens, some samples straddling the split at token 1,024; the
2-rank run is stopped after step 2 and resumed. Its losses and final weights equal the
uninterrupted 1-rank run's to fp64 rounding (1e-10). One launch of each serves every claim.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.conftest import (
    DEMO_MODEL,
    events,
    final_weights,
    make_run,
    max_abs_diff,
    run,
)

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "assets" / "data" / "tiny-text.jsonl"
SEQ = 2048
TOL = 1e-10


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded LLaMA-style model of 2,048+ positions with one key/value head."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("long-model")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def runs(long_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The 1-rank run, and the 2-rank split run stopped after step 2 and resumed."""
    root = tmp_path_factory.mktemp("sp")
    common = {"micro": 1, "dtype": "fp64", "seq_len": SEQ, "pack": True, "lr": 1e-2}
    one = make_run(root, long_model, TEXT, name="one", world=1, **common)
    assert run(one, 1) == 0
    two = make_run(root, long_model, TEXT, name="split", world=2, sequence_parallel=2,
                   train={"checkpoint_every": 1}, **common)  # fmt: skip
    assert run(two, 2, stop_at=2) == 0
    assert events(two, "end")[-1]["reason"] == "stopped"
    assert run(two, 2, resume=True) == 0
    return {"one": one, "split": two}


def test_split_run_equals_one_rank(runs: dict[str, Path]) -> None:
    one, two = runs["one"], runs["split"]
    losses_one = {e["step"]: e["loss"] for e in events(one, "step")}
    losses_two = {e["step"]: e["loss"] for e in events(two, "step")}
    assert sorted(losses_one) == sorted(losses_two) == [1, 2, 3]
    for step, loss in losses_one.items():
        assert abs(losses_two[step] - loss) < TOL, (step, loss, losses_two[step])
    assert max_abs_diff(final_weights(one), final_weights(two)) < TOL
    assert events(two, "end")[-1]["reason"] == "completed"
