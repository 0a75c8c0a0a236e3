"""`homelab-dp measure` on a tiny Mixture-of-Experts model (2 CPU ranks under torchrun) agrees
with the plan within 5%: every expert's weights, gradients and AdamW state, and the routed
tokens' activations (issue 23's acceptance; one launch of about 15 s)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_dp.cli import main
from homelab_dp.planning.model_spec import load_model_spec
from tests.conftest import write_preset
from tests.integration.conftest import DEMO_MODEL

pytestmark = pytest.mark.slow
BOUND = 0.05


def tiny_qwen3_moe(out: Path) -> Path:
    """A seeded random Qwen3-MoE (hidden 64, 2 layers, 16 experts, top-2) with the demo tokenizer:
    the experts hold most of the weights, the routed tokens most of the activations."""
    import torch
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(DEMO_MODEL)
    config = tf.Qwen3MoeConfig(
        vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, moe_intermediate_size=64,
        num_experts=16, num_experts_per_tok=2, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def test_measure_on_a_tiny_moe_agrees_with_the_plan(
    data_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tiny_qwen3_moe(tmp_path / "qwen3-moe")
    spec = load_model_spec(model)
    assert spec.experts is not None
    experts = spec.experts.layers * spec.experts.count * spec.experts.expert_params
    assert experts > spec.params / 2  # the experts dominate what is measured
    preset = write_preset(tmp_path, "moe", model, data_dir / "ragged-64.jsonl", seq_len=256,
                          pack=True, micro_batch=4, max_steps=10)  # fmt: skip
    assert main(["measure", str(preset), "--steps", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["method"], out["distribution"]) == ("full", "ddp")
    assert abs(out["error"]) <= BOUND, (out["estimate"]["tensor_bytes"], out["measured_peak_bytes"])
    est = out["estimate"]
    for r in out["ranks"]:
        assert r["peak_phase"] == est["peak_phase"]
        # Every expert's fp32 weights, loaded and counted exactly.
        assert r["peak_by_category"]["weights"] == spec.params * 4
        got = r["phases"]["backward"]["peak_bytes"]
        assert abs(est["phases"]["backward"] - got) / got <= BOUND
