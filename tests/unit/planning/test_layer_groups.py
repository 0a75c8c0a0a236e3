"""A model is a list of layers (issue 36): the census of the 2026 families against transformers.

Tiny configs of the nine families the issue names are built by transformers' own config classes,
instantiated on the meta device, and planned through the census (`train.model.model_census`, the path
`plan` takes for them): the parameter count must equal the meta model's, parameter for parameter;
the active count must equal it minus the routed experts a token skips (counted from the model's
own expert tensors); the layers per mixer kind must follow the config's layer pattern.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers.models.auto.configuration_auto import CONFIG_MAPPING  # noqa: E402

from homelab_dp.planning.model_spec import spec_to_dict  # noqa: E402
from homelab_dp.planning.spec_document import spec_from_dict  # noqa: E402
from homelab_dp.train.model.model_census import census  # noqa: E402

T = {"hidden_size": 64, "vocab_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
     "head_dim": 16, "intermediate_size": 96, "max_position_embeddings": 256}  # fmt: skip
GDN = {"linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
       "linear_value_head_dim": 16}  # fmt: skip
MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
LIN, FULL, SLIDE = "linear_attention", "full_attention", "sliding_attention"

# model_type: (config fields, expected layers per mixer kind)
FAMILIES = {
    "qwen3_5_text": ({**T, **GDN, "num_hidden_layers": 4}, {"linear_attention": 3, "gated_attention": 1}),
    "qwen3_5_moe_text": ({**T, **GDN, **MOE, "shared_expert_intermediate_size": 48,
                          "num_hidden_layers": 4}, {"linear_attention": 3, "gated_attention": 1}),
    "qwen3_next": ({**T, **GDN, **MOE, "shared_expert_intermediate_size": 48, "num_hidden_layers": 8,
                    "mlp_only_layers": [0]}, {"linear_attention": 6, "gated_attention": 2}),
    "nemotron_h": ({**T, "num_hidden_layers": 6, "hybrid_override_pattern": "M-M*EM",
                    "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16, "n_groups": 1,
                    "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "moe_shared_expert_intermediate_size": 48}, {"mamba2": 3, "none": 2, "attention": 1}),
    "falcon_h1": ({**T, "num_hidden_layers": 3, "mamba_n_heads": 4, "mamba_d_head": 16,
                   "mamba_d_ssm": 64, "mamba_d_state": 16}, {"attention+mamba2": 3}),
    "granitemoehybrid": ({**T, "num_hidden_layers": 4, "layer_types": ["mamba", "attention", "mamba", "mamba"],
                          "mamba_n_heads": 4, "mamba_d_head": 32, "mamba_d_state": 16,
                          "num_local_experts": 4, "num_experts_per_tok": 2}, {"mamba2": 3, "attention": 1}),
    "lfm2": ({**T, "num_hidden_layers": 5, "full_attn_idxs": [1, 3]}, {"short_conv": 3, "attention": 2}),
    "ernie4_5_moe": ({**T, "num_hidden_layers": 4, "moe_num_experts": 8, "moe_k": 2,
                      "moe_intermediate_size": 32, "moe_layer_start_index": 1}, {"attention": 4}),
    "gemma4_text": ({**T, "num_hidden_layers": 6, "layer_types": [SLIDE, FULL] * 3, "global_head_dim": 32,
                     "hidden_size_per_layer_input": 8, "vocab_size_per_layer_input": 128,
                     "enable_moe_block": True, "num_experts": 4, "top_k_experts": 2,
                     "moe_intermediate_size": 16, "num_kv_shared_layers": 2},
                    {"sliding_attention": 3, "attention": 3}),
}  # fmt: skip


def _meta_model(cfg):
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(cfg)


def _inactive(model, top_k: int) -> int:
    """Parameters of the routed experts a token skips, from the model's own tensors: in each
    MoE block (E, ...) expert stacks, (E - top_k) / E of them."""
    out = 0
    for name, p in model.named_parameters():
        if ".experts." in name and p.dim() == 3:
            out += p.numel() * (p.shape[0] - top_k) // p.shape[0]
    return out


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_census_counts_every_parameter_of_the_2026_families(model_type, tmp_path):
    fields, mixers = FAMILIES[model_type]
    cfg = CONFIG_MAPPING[model_type](**fields)
    model = _meta_model(cfg)
    truth = sum(p.numel() for p in model.parameters())
    cfg.save_pretrained(tmp_path)
    spec = census(tmp_path)
    assert spec.params == truth
    top_k = getattr(cfg, "num_experts_per_tok", None) or getattr(cfg, "top_k_experts", None)
    top_k = top_k or getattr(cfg, "moe_k", None) or 0
    assert spec.active_params == truth - (_inactive(model, top_k) if top_k else 0)
    assert spec.mixer_counts == mixers
    assert spec.layers == sum(g.count for g in spec.layer_groups) == cfg.num_hidden_layers
    # The spec travels as JSON (the census child, the cache) and comes back the same.
    again = spec_from_dict(json.loads(json.dumps(spec_to_dict(spec))))
    assert again == spec and again.params == truth


def test_hybrid_layers_say_what_carries_a_recurrent_state(tmp_path):
    fields, _ = FAMILIES["qwen3_5_text"]
    CONFIG_MAPPING["qwen3_5_text"](**fields).save_pretrained(tmp_path)
    spec = census(tmp_path)
    assert (spec.state_layers, spec.attention_layers) == (3, 1)
    gdn = next(m for g in spec.layer_groups for m in g.kind.mixers if m.kind == "linear_attention")
    assert (gdn.dim("k_heads"), gdn.dim("v_heads"), gdn.dim("k_dim"), gdn.dim("v_dim")) == (
        2,
        4,
        16,
        16,
    )
    assert gdn.dim("conv_kernel") == 4


def test_moe_with_dense_first_layers_has_both_groups(tmp_path):
    fields, _ = FAMILIES["ernie4_5_moe"]
    CONFIG_MAPPING["ernie4_5_moe"](**fields).save_pretrained(tmp_path)
    spec = census(tmp_path)
    moe = [g for g in spec.layer_groups if g.kind.experts is not None]
    dense = [g for g in spec.layer_groups if g.kind.experts is None]
    assert [g.count for g in moe] == [3] and [g.count for g in dense] == [1]
    assert moe[0].kind.experts.count == 8 and moe[0].kind.experts.top_k == 2
    assert spec.experts is not None and spec.experts.layers == 3


# --- activations per layer kind, against the bytes autograd saves on the CPU -----------------

# The measurement is benchmarks/layer_kinds.py's own (its table in docs/models.md), so the
# test and the benchmark measure alike; the test takes three of its families.
_bench_spec = importlib.util.spec_from_file_location(
    "layer_kinds_bench", Path(__file__).resolve().parents[3] / "benchmarks" / "layer_kinds.py"
)
assert _bench_spec and _bench_spec.loader
layer_kinds_bench = importlib.util.module_from_spec(_bench_spec)
_bench_spec.loader.exec_module(layer_kinds_bench)
MEASURED_FAMILIES = {
    name: layer_kinds_bench.FAMILIES[name] for name in ("qwen3_5_text", "nemotron_h", "lfm2")
}


def _saved_per_token(model, index: int, seq: int) -> float:
    """Bytes per token autograd saves in decoder layer ``index`` (weights left out)."""
    return layer_kinds_bench.saved_bytes(model, index, seq) / seq


@pytest.mark.parametrize("model_type", sorted(MEASURED_FAMILIES))
def test_planned_activations_per_layer_kind_match_what_autograd_saves(model_type, tmp_path):
    """Every layer kind of Qwen3.5 (Gated DeltaNet, gated attention), Nemotron-H (Mamba-2,
    attention, MLP, MoE) and LFM2 (short convolution, attention with q/k norms): the plan's
    bytes per token within 5% of what the torch reference path saves (fp32, full fine-tune)."""
    from homelab_dp.planning.memory.layer_kinds import kind_activation_bytes
    from homelab_dp.train.model.model_census import layer_groups

    torch.manual_seed(0)
    cfg = CONFIG_MAPPING[model_type](**MEASURED_FAMILIES[model_type])
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().train()
    cfg.save_pretrained(tmp_path)
    spec = census(tmp_path)
    for group, ids in layer_groups(model, cfg):
        measured = _saved_per_token(model, ids[0], 256)
        planned = kind_activation_bytes(
            spec, group.kind, 4, experts_trained=True, frozen_norms=False
        )
        assert planned == pytest.approx(measured, rel=0.05), group.kind.mixer


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_planned_lora_parameters_equal_peft_s_on_every_layer_kind(model_type, tmp_path):
    """The worker's "all-linear" LoRA (`train.model.lora.add_lora`, through peft) on every family:
    its trainable count equals the plan's. Every decoder linear the plan counts is adapted
    (Mamba's out_proj left out: peft refuses it on Mamba families; Gemma 4's
    ``per_layer_input_gate`` is no router) and nothing else (no router, no model-level linear:
    Gemma 4's ``per_layer_model_projection`` used to be adapted and not planned)."""
    from types import SimpleNamespace

    from homelab_dp.planning.memory.moe_memory import lora_param_count
    from homelab_dp.train.model.lora import add_lora

    fields, _ = FAMILIES[model_type]
    cfg = CONFIG_MAPPING[model_type](**fields)
    cfg.save_pretrained(tmp_path)
    spec = census(tmp_path)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    lora = add_lora(model, SimpleNamespace(r=4, alpha=8, dropout=0.0, target_modules="all-linear"))
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert trainable == lora_param_count(spec, 4, "all-linear")
    if spec.blocks:
        assert trainable == spec.lora_params(4)


def test_serving_keeps_keys_and_values_of_attention_layers_and_the_state_of_the_others(tmp_path):
    """Qwen3.5: the KV cache grows with the context in its one attention layer only; each Gated
    DeltaNet layer keeps a fixed state (value heads × d_k × d_v) and its convolution window."""
    from homelab_dp.planning.serve_plan import kv_cache_bytes

    fields, _ = FAMILIES["qwen3_5_text"]
    CONFIG_MAPPING["qwen3_5_text"](**fields).save_pretrained(tmp_path)
    spec = census(tmp_path)
    kv = 2 * 2 * 16  # keys and values, 2 KV heads of 16, per token, in the 1 attention layer
    conv = 2 * 2 * 16 + 4 * 16  # q, k (2 heads of 16) and v (4 heads of 16) through the conv
    state = 4 * 16 * 16 + (4 - 1) * conv  # per Gated DeltaNet layer, whatever the context
    for context in (128, 4096):
        assert kv_cache_bytes(spec, context, 3, 2) == 3 * 2 * (kv * context + 3 * state)


@pytest.mark.parametrize("model_type", ["qwen3_5_moe_text", "nemotron_h", "falcon_h1", "lfm2"])
def test_flops_count_the_weights_a_token_multiplies_by_in_every_layer_kind(model_type, tmp_path):
    """The time model's N (`linear_matmul_params`): every nn.Linear weight of the decoder layers
    (a routed expert stack at top-k of E, the router), and lm_head — counted here from the meta
    model's own modules."""
    from homelab_dp.planning.flops import linear_matmul_params

    fields, _ = FAMILIES[model_type]
    cfg = CONFIG_MAPPING[model_type](**fields)
    model = _meta_model(cfg)
    cfg.save_pretrained(tmp_path)
    spec = census(tmp_path)
    top_k = getattr(cfg, "num_experts_per_tok", None) or 0
    expected = spec.vocab * spec.hidden  # lm_head multiplies by the vocabulary, tied or not
    for module in model.model.layers.modules():
        if isinstance(module, torch.nn.Linear):
            expected += module.in_features * module.out_features
    for name, p in model.model.layers.named_parameters():
        if ".experts." in f".{name}" and p.dim() == 3:
            expected += p.numel() * top_k // p.shape[0]
        elif p.dim() == 2 and name.endswith("gate.weight") and p.shape[1] == spec.hidden:
            parent = model.model.layers.get_submodule(name.rsplit(".", 1)[0])
            if not isinstance(parent, torch.nn.Linear):  # a router kept as a bare weight
                expected += p.numel()
    assert linear_matmul_params(spec) == expected
