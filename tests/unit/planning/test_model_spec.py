"""Parameter counts from config.json alone, against transformers on the meta device."""

from __future__ import annotations

import json

import pytest

from homelab_dp.errors import ModelSpecError
from homelab_dp.planning.model_spec import load_model_spec, spec_from_config

# Small configs of every supported family, with the features that change the count:
# GQA, explicit head_dim, tied and untied embeddings, biases, extra norms.
FAMILY_CONFIGS = {
    "llama-gqa": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 160,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "tie_word_embeddings": False,
    },
    "llama-bias-tied": {
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 3,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "vocab_size": 257,
        "attention_bias": True,
        "mlp_bias": True,
        "tie_word_embeddings": True,
    },
    "mistral": {
        "model_type": "mistral",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 320,
    },
    "qwen2-tied": {
        "model_type": "qwen2",
        "hidden_size": 64,
        "intermediate_size": 112,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 400,
        "tie_word_embeddings": True,
    },
    "qwen2-untied": {
        "model_type": "qwen2",
        "hidden_size": 48,
        "intermediate_size": 112,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 400,
        "tie_word_embeddings": False,
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "vocab_size": 500,
        "tie_word_embeddings": True,
    },
    "gemma": {
        "model_type": "gemma",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "vocab_size": 300,
    },
    "gemma2": {
        "model_type": "gemma2",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 300,
    },
    "phi3": {
        "model_type": "phi3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 300,
        "pad_token_id": 0,
    },
    "gpt2": {
        "model_type": "gpt2",
        "n_embd": 64,
        "n_layer": 2,
        "n_head": 4,
        "n_positions": 128,
        "vocab_size": 300,
    },
    "gpt2-inner": {
        "model_type": "gpt2",
        "n_embd": 48,
        "n_layer": 3,
        "n_head": 4,
        "n_positions": 64,
        "n_inner": 100,
        "vocab_size": 211,
    },
}

# Published parameter counts of well-known models, from their public config.json values.
PUBLISHED = {
    "gpt2": (
        {
            "model_type": "gpt2",
            "n_embd": 768,
            "n_layer": 12,
            "n_head": 12,
            "n_positions": 1024,
            "vocab_size": 50257,
        },
        124_439_808,
    ),
    "Llama-2-7b": (
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 11008,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32000,
            "tie_word_embeddings": False,
        },
        6_738_415_616,
    ),
    "Meta-Llama-3-8B": (
        {
            "model_type": "llama",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "tie_word_embeddings": False,
        },
        8_030_261_248,
    ),
    "Mistral-7B-v0.1": (
        {
            "model_type": "mistral",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 32000,
            "tie_word_embeddings": False,
        },
        7_241_732_096,
    ),
    "Qwen2-0.5B": (
        {
            "model_type": "qwen2",
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
        },
        494_032_768,
    ),
    "SmolLM-135M": (
        {
            "model_type": "llama",
            "hidden_size": 576,
            "intermediate_size": 1536,
            "num_hidden_layers": 30,
            "num_attention_heads": 9,
            "num_key_value_heads": 3,
            "vocab_size": 49152,
            "tie_word_embeddings": True,
        },
        134_515_008,
    ),
    "gemma-2b": (
        {
            "model_type": "gemma",
            "hidden_size": 2048,
            "intermediate_size": 16384,
            "num_hidden_layers": 18,
            "num_attention_heads": 8,
            "num_key_value_heads": 1,
            "head_dim": 256,
            "vocab_size": 256000,
        },
        2_506_172_416,
    ),
    "gemma-2-2b": (
        {
            "model_type": "gemma2",
            "hidden_size": 2304,
            "intermediate_size": 9216,
            "num_hidden_layers": 26,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "head_dim": 256,
            "vocab_size": 256000,
        },
        2_614_341_888,
    ),
    "Phi-3-mini-4k": (
        {
            "model_type": "phi3",
            "hidden_size": 3072,
            "intermediate_size": 8192,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 32,
            "vocab_size": 32064,
            "tie_word_embeddings": False,
        },
        3_821_079_552,
    ),
}


def _meta_count(cfg: dict) -> int:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(FAMILY_CONFIGS))
def test_count_matches_meta_device_instantiation(name: str, tmp_path) -> None:
    cfg = FAMILY_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model_spec(tmp_path)
    assert spec.params == _meta_count(cfg)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_count_matches_published(name: str) -> None:
    cfg, published = PUBLISHED[name]
    assert spec_from_config(cfg).params == published


def test_shapes_from_config() -> None:
    spec = spec_from_config(PUBLISHED["Meta-Llama-3-8B"][0])
    assert (spec.layers, spec.hidden, spec.heads, spec.kv_heads) == (32, 4096, 32, 8)
    assert (spec.head_dim, spec.intermediate, spec.vocab) == (128, 14336, 128256)
    assert not spec.tied_embeddings
    # QLoRA quantizes the decoder linears: all but embeddings, lm_head and norms.
    assert spec.quantizable_params == 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)


def test_lora_params_all_linear_and_named() -> None:
    spec = spec_from_config(FAMILY_CONFIGS["llama-gqa"])
    # q: 64->64, k: 64->32, v: 64->32, o: 64->64, gate/up: 64->160, down: 160->64
    per_layer_all = 8 * (128 + 96 + 96 + 128 + 224 + 224 + 224)
    assert spec.lora_params(8) == 2 * per_layer_all
    assert spec.lora_params(8, ["q_proj", "v_proj"]) == 2 * 8 * (128 + 96)


def test_unknown_architecture_names_the_file(tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba", "hidden_size": 8}))
    with pytest.raises(ModelSpecError) as err:
        load_model_spec(tmp_path)
    assert "config.json" in err.value.message and "mamba" in err.value.message
    assert "llama" in err.value.hint


def test_missing_folder_and_config(tmp_path) -> None:
    with pytest.raises(ModelSpecError, match="model.path"):
        load_model_spec(tmp_path / "nope")
    with pytest.raises(ModelSpecError, match="config.json: missing"):
        load_model_spec(tmp_path)
