"""Hand-written specs of the issue-23 families against transformers 5 on the meta device.

Configs at published sizes are built with transformers' own config classes (so every field a
config.json may leave out takes the class default), the model is instantiated once on the meta
device, and `spec_from_config` must give the same parameter count to the parameter; for MoE
models `active_params` must equal that count minus the routed experts a token does not use.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from homelab_dp.planning.model_spec import spec_from_config  # noqa: E402
from homelab_dp.train.model.model_census import census  # noqa: E402

# Published sizes (config.json of the released checkpoints, fields that change the count).
PUBLISHED: dict[str, dict[str, Any]] = {
    "Qwen3-30B-A3B": {
        "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048,
        "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
        "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
        "num_experts": 128, "num_experts_per_tok": 8, "tie_word_embeddings": False,
    },
    "Mixtral-8x7B": {
        "model_type": "mixtral", "vocab_size": 32000, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    },
    "gpt-oss-20b": {
        "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
        "intermediate_size": 2880, "num_hidden_layers": 24, "num_attention_heads": 64,
        "num_key_value_heads": 8, "head_dim": 64, "num_local_experts": 32,
        "num_experts_per_tok": 4, "sliding_window": 128,
        "quantization_config": {"quant_method": "mxfp4"},
    },
    "gemma-3-1b-text": {
        "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 256, "sliding_window": 512,
    },
    "gemma-3-4b-text": {
        "model_type": "gemma3_text", "vocab_size": 262208, "hidden_size": 2560,
        "intermediate_size": 10240, "num_hidden_layers": 34, "num_attention_heads": 8,
        "num_key_value_heads": 4, "head_dim": 256, "sliding_window": 1024,
        "final_logit_softcapping": 30.0,
    },
    "gemma-3-4b": {
        "model_type": "gemma3",
        "text_config": {
            "vocab_size": 262208, "hidden_size": 2560, "intermediate_size": 10240,
            "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "sliding_window": 1024,
        },
        "vision_config": {
            "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
            "num_attention_heads": 16, "patch_size": 14, "image_size": 896,
            "vision_use_head": False,
        },
    },
    "OLMo-2-1124-7B": {
        "model_type": "olmo2", "vocab_size": 100352, "hidden_size": 4096,
        "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32,
    },
    "granite-3.1-8b": {
        "model_type": "granite", "vocab_size": 49155, "hidden_size": 4096,
        "intermediate_size": 12800, "num_hidden_layers": 40, "num_attention_heads": 32,
        "num_key_value_heads": 8, "tie_word_embeddings": True, "logits_scaling": 16.0,
    },
    "SmolLM3-3B": {
        "model_type": "smollm3", "vocab_size": 128256, "hidden_size": 2048,
        "intermediate_size": 11008, "num_hidden_layers": 36, "num_attention_heads": 16,
        "num_key_value_heads": 4, "tie_word_embeddings": True,
    },
    "GLM-4-9B-0414": {
        "model_type": "glm4", "vocab_size": 151552, "hidden_size": 4096,
        "intermediate_size": 13696, "num_hidden_layers": 40, "num_attention_heads": 32,
        "num_key_value_heads": 2, "head_dim": 128, "attention_bias": True,
    },
    "DeepSeek-V2-Lite": {
        "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
        "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16,
        "num_key_value_heads": 16, "q_lora_rank": None, "kv_lora_rank": 512,
        "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
        "moe_intermediate_size": 1408, "n_routed_experts": 64, "n_shared_experts": 2,
        "num_experts_per_tok": 6, "first_k_dense_replace": 1,
    },
}  # fmt: skip

# Small configs that switch on what the published ones leave off.
VARIANTS: dict[str, dict[str, Any]] = {
    "qwen3_moe-dense-layers": {
        "model_type": "qwen3_moe", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "num_hidden_layers": 5, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_experts": 6, "num_experts_per_tok": 2,
        "mlp_only_layers": [0], "decoder_sparse_step": 2, "attention_bias": True,
        "tie_word_embeddings": True,
    },
    "qwen2_moe": {
        "model_type": "qwen2_moe", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
        "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 6, "num_experts_per_tok": 2, "mlp_only_layers": [1],
    },
    "olmoe": {
        "model_type": "olmoe", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 32,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_experts": 8, "num_experts_per_tok": 2,
    },
    "gpt_oss-layer-types": {
        "model_type": "gpt_oss", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 48,
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    },
    "deepseek_v2-q-lora": {
        "model_type": "deepseek_v2", "vocab_size": 300, "hidden_size": 64,
        "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
        "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
        "v_head_dim": 8, "moe_intermediate_size": 16, "n_routed_experts": 4,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 2,
        "attention_bias": True,
    },
    "olmo2-gqa": {
        "model_type": "olmo2", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attention_bias": True,
    },
    "granite-bias": {
        "model_type": "granite", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attention_bias": True, "mlp_bias": True,
    },
    "smollm3-untied-bias": {
        "model_type": "smollm3", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "tie_word_embeddings": False, "attention_bias": True, "mlp_bias": True,
    },
    "glm4-no-bias": {
        "model_type": "glm4", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "attention_bias": False, "tie_word_embeddings": True,
    },
    "gemma3-head-default": {
        "model_type": "gemma3", "text_config": {
            "vocab_size": 300, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "head_dim": 32,
        },
        "vision_config": {"hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 1,
                          "num_attention_heads": 2, "patch_size": 8, "image_size": 32},
    },
}  # fmt: skip

MOE_TOP_K = {"Qwen3-30B-A3B", "Mixtral-8x7B", "gpt-oss-20b", "DeepSeek-V2-Lite"}


def _config(cfg: dict[str, Any]) -> Any:
    """transformers' config object for ``cfg`` (special tokens off: the small vocabularies)."""
    kwargs = {k: v for k, v in cfg.items() if k != "model_type"}
    tokens = {"pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    if "text_config" in kwargs:
        kwargs["text_config"] = {**tokens, **kwargs["text_config"]}
    return transformers.AutoConfig.for_model(cfg["model_type"], **tokens, **kwargs)


def _config_dict(cfg: dict[str, Any]) -> dict[str, Any]:
    """The config.json transformers writes for ``cfg`` (every field, defaults included)."""
    return json.loads(_config(cfg).to_json_string(use_diff=False))


def _meta_count(cfg: dict[str, Any]) -> tuple[int, int]:
    """Total parameters and those of the routed experts a token skips, on the meta device."""
    config = _config(cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())
    inactive = 0
    for name, p in model.named_parameters():
        if ".experts." in name and not name.split(".experts.")[0].endswith("shared"):
            count = p.shape[0]  # fused experts: [experts, ...]
            inactive += p.numel() // count * (count - _top_k(config))
    return total, inactive


def _top_k(config: Any) -> int:
    return int(getattr(config.get_text_config(), "num_experts_per_tok", 0) or 0)


@pytest.fixture(scope="module")
def meta_counts() -> dict[str, tuple[int, int]]:
    """Every config built once on the meta device (the 30B-class ones take seconds)."""
    return {name: _meta_count(cfg) for name, cfg in {**PUBLISHED, **VARIANTS}.items()}


@pytest.mark.parametrize("name", [*PUBLISHED, *VARIANTS])
def test_params_equal_meta_device_count(name: str, meta_counts: dict[str, tuple[int, int]]) -> None:
    cfg = {**PUBLISHED, **VARIANTS}[name]
    spec = spec_from_config(_config_dict(cfg))
    total, inactive = meta_counts[name]
    assert spec.params == total
    assert spec.active_params == total - inactive - spec.vision_params
    assert spec.quantizable_params < spec.params
    if name in MOE_TOP_K:
        assert spec.experts is not None and inactive > 0
        assert spec.active_params < spec.params / 2  # a MoE's point: most experts idle


def test_published_sizes_read_as_their_names() -> None:
    """The counts a model card states (rounded), so a wrong config in this file shows up."""
    billions = {name: spec_from_config(_config_dict(cfg)) for name, cfg in PUBLISHED.items()}
    assert round(billions["Qwen3-30B-A3B"].params / 1e9, 1) == 30.5
    assert round(billions["Qwen3-30B-A3B"].active_params / 1e9, 1) == 3.4  # card: 3.3B w/o lm_head
    assert round(billions["Mixtral-8x7B"].params / 1e9, 1) == 46.7
    assert round(billions["Mixtral-8x7B"].active_params / 1e9, 1) == 12.9
    assert round(billions["gpt-oss-20b"].params / 1e9, 1) == 20.9
    assert round(billions["gpt-oss-20b"].active_params / 1e9, 1) == 4.2  # card: 3.6B w/o embeddings
    assert round(billions["DeepSeek-V2-Lite"].params / 1e9, 1) == 15.7


def test_family_features_are_reported() -> None:
    """Sliding-window layers, soft-capped logits, pre-quantization and dense MoE layers."""
    gemma = spec_from_config(_config_dict(PUBLISHED["gemma-3-1b-text"]))
    assert (gemma.sliding_window, gemma.sliding_layers) == (512, 26 - 4)  # every 6th is global
    assert gemma.full_logits is False
    assert spec_from_config(_config_dict(PUBLISHED["gemma-3-4b-text"])).full_logits is True
    assert spec_from_config(_config_dict(PUBLISHED["granite-3.1-8b"])).full_logits is True
    oss = spec_from_config(_config_dict(PUBLISHED["gpt-oss-20b"]))
    assert (oss.quantization, oss.sliding_layers, oss.experts.top_k) == ("mxfp4", 12, 4)
    assert oss.experts.router_params == 32 * 2880 + 32  # router weight and bias
    lite = spec_from_config(_config_dict(PUBLISHED["DeepSeek-V2-Lite"]))
    assert (lite.moe_layers, lite.experts.count, len(lite.experts.shared)) == (26, 64, 3)
    qwen = spec_from_config(_config_dict(VARIANTS["qwen3_moe-dense-layers"]))
    assert qwen.moe_layers == 2  # layers 1 and 3: step 2, layer 0 listed as dense
    wrapper = spec_from_config(_config_dict(PUBLISHED["gemma-3-4b"]))
    assert wrapper.vision_params > 400_000_000  # SigLIP-So400m and the projector


TINY = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip


@pytest.mark.parametrize("model_type", ["starcoder2", "cohere", "stablelm"])
def test_census_counts_a_family_not_written_by_hand(model_type, tmp_path) -> None:
    cfg = {"model_type": model_type, **TINY}
    _config(cfg).save_pretrained(tmp_path)
    spec = census(tmp_path)
    assert spec.params == _meta_count(cfg)[0] and spec.source == "meta-device"
    assert spec.layers == 2 and spec.linears and spec.norm_params_per_layer > 0


@pytest.mark.parametrize(
    "name", ["qwen3_moe-dense-layers", "qwen2_moe", "olmoe", "gpt_oss-layer-types",
             "olmo2-gqa", "glm4-no-bias", "gemma3-head-default"],
)  # fmt: skip
def test_census_reads_the_tree_as_the_hand_written_spec(name, tmp_path) -> None:
    """The module-tree reading gives the hand-written spec field for field (linears, experts
    and router, shared experts, dense layers, norms, q/k norms, sinks, vision tower)."""
    _config(VARIANTS[name]).save_pretrained(tmp_path)
    hand = spec_from_config(json.loads((tmp_path / "config.json").read_text()))
    assert census(tmp_path) == replace(hand, source="meta-device")


def test_census_describes_a_hybrid_model_by_its_layer_groups(tmp_path) -> None:
    """Jamba mixes attention and Mamba layers (issue 36): once refused, now described layer
    kind by layer kind, its count equal to transformers' own on the meta device."""
    cfg = _config({**TINY, "model_type": "jamba", "num_hidden_layers": 8, "num_experts": 2})
    cfg.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    spec = census(tmp_path)
    assert spec.params == sum(p.numel() for p in model.parameters())
    assert spec.mixer_counts == {"mamba": 7, "attention": 1}
    assert spec.state_layers == 7 and spec.blocks
