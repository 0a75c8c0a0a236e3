"""The worker's MoE parts on tiny random models: LoRA targets, the router aux loss, the loss path.

Each model is built here from its transformers config class (hidden 16, one or two layers), so
the checks run in a second and need no run folder.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
import transformers as tf

from homelab_dp.errors import HomelabError
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.model.lora import add_lora, lora_targets, prepare_frozen_base
from homelab_dp.train.model.loss import install_loss_head, router_aux_coef, unsupported_reason
from homelab_dp.train.model.trainable_model import (
    LoadedModel,
    decoder_layers,
    experts_implementation,
)
from homelab_dp.train.objectives.sft import micro_step
from homelab_dp.train.parallelism.strategy import is_unfused_moe, wrap_model

COMMON = dict(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=1, head_dim=8, max_position_embeddings=64,
              tie_word_embeddings=False)  # fmt: skip


def qwen3_moe(aux: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.Qwen3MoeConfig(**COMMON, intermediate_size=32, moe_intermediate_size=8,
                               num_experts=4, num_experts_per_tok=2,
                               output_router_logits=aux > 0, router_aux_loss_coef=aux)  # fmt: skip
    return tf.AutoModelForCausalLM.from_config(config, experts_implementation="eager")


def gpt_oss() -> torch.nn.Module:
    torch.manual_seed(0)
    config = tf.GptOssConfig(**COMMON, intermediate_size=8, num_local_experts=4,
                             num_experts_per_tok=2, sliding_window=8,
                             layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    return tf.AutoModelForCausalLM.from_config(config)


def olmo2() -> torch.nn.Module:
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(tf.Olmo2Config(**COMMON, intermediate_size=32))


def lora(targets: object) -> SimpleNamespace:
    return SimpleNamespace(r=2, alpha=4, dropout=0.0, target_modules=targets)


def trainable(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


@pytest.mark.parametrize("build", [qwen3_moe, gpt_oss])
def test_all_linear_on_moe_leaves_router_and_experts_frozen(build) -> None:
    model = build().train()
    prepare_frozen_base(model, gradient_checkpointing=False)
    peft = add_lora(model, lora("all-linear"))
    names = trainable(peft)
    assert names and all(".self_attn." in n and ".lora_" in n for n in names), names
    # 2 layers × q, k, v, o × (A, B); peft's own all-linear adapts the router (and the
    # experts of Qwen3-MoE) too
    assert len(names) == 16


@pytest.mark.parametrize("build", [qwen3_moe, gpt_oss])
def test_naming_experts_adapts_the_fused_weights(build) -> None:
    model = build()
    modules, parameters = lora_targets(model, ["all-linear", "experts"])
    assert sorted(parameters) == sorted(
        f"model.layers.{i}.mlp.experts.{w}" for i in range(2) for w in ("gate_up_proj", "down_proj")
    )
    assert not any(m.rsplit(".", 1)[-1] == "gate" or "router" in m for m in modules)
    _, only_down = lora_targets(model, ["experts.down_proj"])
    assert only_down == [f"model.layers.{i}.mlp.experts.down_proj" for i in range(2)]
    prepare_frozen_base(model.train(), gradient_checkpointing=False)
    peft = add_lora(model, lora(["all-linear", "experts"]))
    assert any(".experts." in n for n in trainable(peft))
    assert not any(".gate." in n or ".router." in n for n in trainable(peft))


def test_dense_model_keeps_the_presets_targets_and_refuses_experts() -> None:
    assert lora_targets(olmo2(), "all-linear") == ("all-linear", [])
    with pytest.raises(HomelabError, match="no routed experts"):
        lora_targets(olmo2(), ["all-linear", "experts"])


def test_router_aux_coef_follows_the_config() -> None:
    assert router_aux_coef(qwen3_moe(0.0)) == 0.0
    assert router_aux_coef(qwen3_moe(0.05)) == 0.05
    model = qwen3_moe(0.05)
    model.config.output_router_logits = False  # the model would not add it either
    assert router_aux_coef(model) == 0.0
    assert router_aux_coef(olmo2()) == 0.0


def _resolved(dtype: str = "fp64") -> Resolved:
    return Resolved(method="full", distribution="ddp", activation_checkpointing=False,
                    device="cpu", world_size=1, dtype=dtype, micro_batch=2, grad_accum=2,
                    lr=1e-3)  # type: ignore[arg-type]  # fmt: skip


def test_micro_step_adds_the_aux_loss_weighted_by_accumulation() -> None:
    """One process, accumulation 2: each micro-step trains on CE sum × scale + coef × aux / 2,
    and the log's aux loss is the mean of the micro-steps' aux losses."""
    coef, scale = 0.05, 1 / 17
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (2, 2, 7), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 0, 5:] = 0  # padding: left out of the aux loss by the mask
    labels = torch.randint(3, 64, ids.shape, generator=gen).masked_fill(mask == 0, -100)
    model = qwen3_moe(coef).double().train()
    head = install_loss_head(model)
    strategy = wrap_model(LoadedModel(model, False, 0, 0, decoder_layers(model)), _resolved(),
                          torch.device("cpu"), grad_accum=2)  # fmt: skip
    assert strategy.aux_coef == coef and strategy.grad_accum == 2
    for k in range(2):
        micro_step(strategy, ids[k], mask[k], labels[k], scale,
                   autocast=contextlib.nullcontext, loss_dtype=torch.float64,
                   loss_head=head)  # fmt: skip
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    logged = strategy.take_aux_loss()

    reference = qwen3_moe(coef).double().train()
    auxes = []
    for k in range(2):
        out = reference(input_ids=ids[k], attention_mask=mask[k], output_router_logits=True)
        ce = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1), labels[k].flatten(),
                                               ignore_index=-100, reduction="sum")  # fmt: skip
        (ce * scale + coef * out.aux_loss / 2).backward()
        auxes.append(float(out.aux_loss.detach()))
    for n, p in reference.named_parameters():
        assert torch.allclose(got[n], p.grad, rtol=1e-6, atol=1e-12), n
    router = "model.layers.0.mlp.gate.weight"
    assert got[router].abs().max() > 0  # the router trains on the aux loss
    assert logged == pytest.approx(sum(auxes) / 2, rel=1e-6)
    assert strategy.take_aux_loss() is None  # reset: nothing since the last call


def test_loss_path_and_layers_of_new_families() -> None:
    gemma = tf.AutoModelForCausalLM.from_config(
        tf.Gemma3TextConfig(**COMMON, intermediate_size=32, final_logit_softcapping=30.0)
    )
    assert "final_logit_softcapping" in (unsupported_reason(gemma) or "")
    for model in (qwen3_moe(), gpt_oss(), olmo2()):
        assert unsupported_reason(model) is None
        assert len(decoder_layers(model)) == 2
        assert not is_unfused_moe(model)  # fused experts: every forward uses every weight


def test_fp64_runs_use_the_eager_experts() -> None:
    assert experts_implementation(_resolved("fp64")) == {"experts_implementation": "eager"}
    assert experts_implementation(_resolved("fp32")) == {}


def test_topk_ties_are_broken_alike_on_the_cpu() -> None:
    """Routing ties (equal router probabilities) go to the same experts whatever the batch size
    and however often asked: torch.topk on the CPU (8 experts, top 2: experts 6 and 5, torch
    2.13), so 1 and 2 processes route a tied token alike."""
    picks = set()
    for rows in (1, 5, 300, 300):
        _, idx = torch.topk(torch.full((rows, 8), 0.125), 2, dim=-1)
        picks |= {tuple(row) for row in idx.tolist()}
    assert len(picks) == 1
