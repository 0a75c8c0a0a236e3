"""The rule that turns packing off for recurrent layers (`planning.recurrent_packing`), pure.

config.json as the Hub ships it (Nemotron-H's ``hybrid_override_pattern``, LFM2's
``full_attn_idxs``, Qwen3.5's ``text_config``) and as transformers writes it
(``layers_block_type``, ``layer_types``) name the same recurrent kinds; attention-only families
(LLaMA, Ernie 4.5 MoE, Gemma 4) keep data.pack as asked.
"""

from __future__ import annotations

import pytest

from homelab_dp.planning.recurrent_packing import (
    RECURRENT_KINDS,
    packing_decision,
    recurrent_kinds,
)

CONFIGS = {
    "qwen3_5 (wrapper)": ({"model_type": "qwen3_5", "text_config": {
        "model_type": "qwen3_5_text",
        "layer_types": ["linear_attention"] * 3 + ["full_attention"]}}, ("linear_attention",)),
    "qwen3_next": ({"model_type": "qwen3_next",
                    "layer_types": ["linear_attention", "full_attention"]}, ("linear_attention",)),
    "nemotron_h (Hub)": ({"model_type": "nemotron_h", "hybrid_override_pattern": "M-M*-E"},
                         ("mamba2",)),
    "nemotron_h (written)": ({"model_type": "nemotron_h", "layers_block_type": [
        "linear_attention", "full_attention", "mlp", "moe"]}, ("linear_attention",)),
    "falcon_h1": ({"model_type": "falcon_h1", "num_hidden_layers": 2}, ("mamba2",)),
    "lfm2 (types)": ({"model_type": "lfm2", "layer_types": ["conv", "full_attention"]},
                     ("conv",)),
    "lfm2 (indices)": ({"model_type": "lfm2", "num_hidden_layers": 4, "full_attn_idxs": [1, 3]},
                       ("conv",)),
    "recurrent_gemma": ({"model_type": "recurrent_gemma",
                         "block_types": ["recurrent", "recurrent", "attention"]},
                        ("recurrent",)),
    "mamba": ({"model_type": "mamba"}, ("mamba",)),
    "llama": ({"model_type": "llama", "num_hidden_layers": 4}, ()),
    "gemma3_text": ({"model_type": "gemma3_text",
                     "layer_types": ["sliding_attention", "full_attention"]}, ()),
    "gemma4_text": ({"model_type": "gemma4_text", "enable_moe_block": True,
                     "layer_types": ["sliding_attention", "full_attention"]}, ()),
    "ernie4_5_moe": ({"model_type": "ernie4_5_moe", "moe_layer_start_index": 1}, ()),
    "lfm2 (all attention)": ({"model_type": "lfm2", "num_hidden_layers": 2,
                              "full_attn_idxs": [0, 1]}, ()),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_recurrent_kinds_a_config_declares(name: str) -> None:
    cfg, kinds = CONFIGS[name]
    assert recurrent_kinds(cfg) == kinds
    assert set(kinds) <= RECURRENT_KINDS


def test_packing_is_turned_off_for_a_recurrent_kind_and_the_plan_says_why() -> None:
    d = packing_decision(True, ("mamba2",), "falcon_h1")
    assert (d.pack, d.group_by_length) == (False, True)
    assert "Packing off" in d.reason and "falcon_h1" in d.reason and "mamba2" in d.reason
    assert "grouped by length" in d.reason
    # Asked unpacked: nothing to say, still grouped.
    d = packing_decision(False, ("linear_attention",), "qwen3_5_text")
    assert (d.pack, d.group_by_length, d.reason) == (False, True, "")


@pytest.mark.parametrize("requested", [True, False])
def test_attention_only_models_keep_what_was_asked(requested: bool) -> None:
    for kinds in ((), ("full_attention", "sliding_attention", "moe", "mlp")):
        d = packing_decision(requested, kinds, "llama")
        assert (d.pack, d.group_by_length, d.reason) == (requested, False, "")
