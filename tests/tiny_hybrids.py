"""Tiny random models of the 2026 decoder families, built from config dicts (no network).

Each family is a few layers at hidden size 64 covering every layer kind it has (Gated DeltaNet
and gated full attention, Mamba-2, attention and MLP and MoE layers in a pattern, short
convolutions, a dense first layer then MoE, sliding and full attention with Gemma 4's MoE block
and per-layer inputs), with the demo tokenizer (assets/models/tiny-llama). Built seeded on the
CPU by transformers itself into a folder, about 0.3-0.4 M parameters (1.5 MB in fp32) each, so
nothing binary is shipped: tests build them once per session (`build_tiny`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEMO_MODEL = ROOT / "assets" / "models" / "tiny-llama"

_BASE: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
)  # fmt: skip
_GATED_DELTANET: dict[str, Any] = dict(
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4,
)  # fmt: skip

FAMILIES: dict[str, dict[str, Any]] = {
    # Gated DeltaNet in three of four layers, gated full attention in the fourth.
    "qwen3_5_text": dict(
        num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
        **_GATED_DELTANET,
    ),
    # The same two kinds, each with routed experts and a gated shared expert.
    "qwen3_5_moe_text": dict(
        num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, **_GATED_DELTANET,
    ),
    # Mamba-2, attention, MLP and MoE layers ("M*-E").
    "nemotron_h": dict(
        num_hidden_layers=4, hybrid_override_pattern="M*-E", mamba_num_heads=4,
        mamba_head_dim=16, ssm_state_size=16, n_groups=1, mamba_d_conv=4, chunk_size=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1,
    ),
    # Attention and Mamba-2 side by side in every layer.
    "falcon_h1": dict(
        num_hidden_layers=2, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16,
        mamba_n_groups=1, mamba_d_conv=4, mamba_chunk_size=16,
    ),
    # Short convolutions around one attention layer given by its layer type.
    "lfm2": dict(
        num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"], block_ff_dim=128,
        conv_L_cache=3, block_auto_adjust_ff_dim=False,
    ),
    # A dense first layer, then MoE (routed experts and a shared one).
    "ernie4_5_moe": dict(
        num_hidden_layers=3, moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
        moe_layer_start_index=1, moe_layer_interval=1, moe_num_shared_experts=1,
    ),
    # Sliding then full attention, the MoE block beside the MLP, per-layer inputs.
    "gemma4_text": dict(
        num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
        sliding_window=8, vocab_size_per_layer_input=2048, hidden_size_per_layer_input=8,
        enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
        global_head_dim=16,
    ),
}  # fmt: skip
"""``model_type`` → the config fields of its tiny model (beside `_BASE`)."""


def build_tiny(model_type: str, out: Path, *, seed: int = 0) -> Path:
    """Build the tiny ``model_type`` model with the demo tokenizer into ``out``; return ``out``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    config = AutoConfig.for_model(
        model_type,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **_BASE,
        **FAMILIES[model_type],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
