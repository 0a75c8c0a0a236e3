"""LoRA and QLoRA on the 2026 layer kinds, on tiny random models of each family (tests.tiny_hybrids).

"all-linear" adapts the projections of Gated DeltaNet, Mamba-2 and short-convolution layers that
peft supports, never a router, a convolution, ``A_log``, ``dt_bias`` or a norm, and never what
peft refuses (Mamba's ``out_proj``: a tiny falcon_h1 used to fail there at launch). Every family
trains a LoRA step on the torch reference path in fp32 and fp64. QLoRA keeps Mamba's ``out_proj``
16-bit (mamba-ssm's fused kernel reads its weight directly) and quantizes every other linear.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from peft.tuners.tuners_utils import _check_lora_target_modules_mamba
from torch import nn
from transformers import AutoModelForCausalLM

from homelab_dp.errors import HomelabError
from homelab_dp.nf4_quantization import is_fused_experts, nf4_works
from homelab_dp.planning.memory.device_memory import activation_bytes, chunked_loss
from homelab_dp.planning.memory.train_shape import TrainShape
from homelab_dp.planning.model_layers import nf4_skip_modules
from homelab_dp.planning.plan_reasons import model_reasons
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.model.lora import (
    PEFT_MAMBA_MODEL_TYPES,
    add_lora,
    is_router,
    lora_targets,
    nf4_report,
    nf4_split,
    peft_refuses,
    prepare_frozen_base,
)
from homelab_dp.train.model.loss import unsupported_reason
from homelab_dp.train.model.model_census import census
from homelab_dp.train.model.trainable_model import load_model
from tests.tiny_hybrids import FAMILIES

LORA = SimpleNamespace(r=4, alpha=8, dropout=0.0, target_modules="all-linear")

ADAPTED = {
    "qwen3_5_text": ["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_a",
                     "linear_attn.in_proj_b", "linear_attn.out_proj", "self_attn.q_proj",
                     "self_attn.o_proj", "mlp.down_proj"],
    "qwen3_5_moe_text": ["linear_attn.in_proj_qkv", "linear_attn.out_proj",
                         "shared_expert.up_proj", "self_attn.o_proj"],
    "nemotron_h": ["mixer.in_proj", "mixer.q_proj", "mixer.o_proj", "mixer.up_proj",
                   "shared_experts.down_proj"],
    "falcon_h1": ["mamba.in_proj", "self_attn.o_proj", "feed_forward.down_proj"],
    "lfm2": ["conv.in_proj", "conv.out_proj", "self_attn.out_proj", "feed_forward.w2"],
    # The dense first layer's MLP and the shared experts (peft 0.21 alone renamed them to the
    # routed experts' fused parameters: `homelab_dp.peft_targets`).
    "ernie4_5_moe": ["self_attn.q_proj", "layers.0.mlp.down_proj", "shared_experts.up_proj"],
    "gemma4_text": ["self_attn.q_proj", "mlp.down_proj", "per_layer_projection"],
}  # fmt: skip
"""Module name endings "all-linear" must adapt in each family (some of each layer kind)."""
NEVER = {
    "nemotron_h": ["mixer.out_proj", "mixer.gate"],
    "falcon_h1": ["mamba.out_proj"],
    "gemma4_text": ["router.proj"],
    "ernie4_5_moe": ["mlp.gate", "mlp.experts"],
    "qwen3_5_moe_text": ["mlp.gate", "shared_expert_gate", "mlp.experts"],
}
"""Linears it must leave alone: what peft refuses, routers and a router's own projection."""


def _load(folder: Path, dtype: torch.dtype = torch.float32) -> nn.Module:
    # fp64 takes the eager experts loop, as the worker loads it (`experts_implementation`).
    eager = {"experts_implementation": "eager"} if dtype == torch.float64 else {}
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **eager)
    model.config.use_cache = False
    model.train()
    return model


def _adapted(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if hasattr(m, "lora_A") and "lora_A" not in n]


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_all_linear_adapts_every_supported_projection_and_nothing_else(
    model_type: str, tiny_hybrid: Callable[[str], Path]
) -> None:
    model = prepare_frozen_base(_load(tiny_hybrid(model_type)), gradient_checkpointing=False)
    peft_model = add_lora(model, LORA)  # peft itself refused falcon_h1/nemotron_h's out_proj
    adapted = _adapted(peft_model)
    for ending in ADAPTED[model_type]:
        assert any(n.endswith(ending) for n in adapted), (ending, adapted)
    for ending in NEVER.get(model_type, []):
        assert not any(n.endswith(ending) for n in adapted), (ending, adapted)
    routers = [n for n, m in model.named_modules() if n and is_router(n, m)]
    for name in adapted:
        leaf = name.rsplit(".", 1)[-1]
        assert leaf not in ("conv", "conv1d", "lm_head"), name
        assert not any(name.startswith(r.split("base_model.model.")[-1]) for r in routers), name
    trainable = [n for n, p in peft_model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)


@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_plan_budgets_the_loss_head_the_worker_installs(
    model_type: str, tiny_hybrid: Callable[[str], Path]
) -> None:
    """The chunked cross-entropy where the worker can install it, the full logits where it
    cannot: Falcon-H1's forward multiplies the logits by lm_head_multiplier on the lm_head line,
    so the worker keeps the full logits, which the plan used to price as chunked (`measure` of
    the tiny falcon_h1 was 26% over the plan)."""
    folder = tiny_hybrid(model_type)
    worker_chunks = unsupported_reason(_load(folder)) is None
    assert chunked_loss(census(folder)) == worker_chunks
    assert worker_chunks == (model_type not in ("falcon_h1", "gemma4_text"))


def test_the_plan_budgets_what_a_gemma4_layer_saves_for_backward(
    tiny_hybrid: Callable[[str], Path],
) -> None:
    """Gemma 4's layers (a uniform spec) save what the LLaMA form does and more: five more norms'
    inputs, the dense MLP beside the MoE block, the per-layer input's gate and projection. The
    plan's activations of a LoRA micro-batch are within 10% of the bytes autograd saves (they
    were 45% under, and `measure` of the tiny model 15% under the plan)."""
    folder = tiny_hybrid("gemma4_text")
    model = add_lora(prepare_frozen_base(_load(folder), gradient_checkpointing=False),
                     SimpleNamespace(r=16, alpha=8, dropout=0.0, target_modules="all-linear"))  # fmt: skip
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    torch.manual_seed(0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.model(input_ids=torch.randint(0, 2048, (2, 64)))
    shape = TrainShape(method="lora", distribution="ddp", world_size=1, device="cpu",
                       dtype="fp32", micro_batch=2, seq_len=64, lora_r=16, packed=False)  # fmt: skip
    planned = activation_bytes(census(folder), shape)
    assert abs(planned - sum(saved.values())) <= 0.10 * sum(saved.values())


def test_the_rule_is_peft_own() -> None:
    """`peft_refuses` answers exactly as peft's check does, name by name and family by family."""
    for model_type in sorted(PEFT_MAMBA_MODEL_TYPES | {"qwen3_5_text", "lfm2", "llama"}):
        model = SimpleNamespace(config=SimpleNamespace(model_type=model_type))
        for leaf in ("out_proj", "conv1d", "in_proj", "o_proj", "in_proj_qkv", "conv"):
            try:
                _check_lora_target_modules_mamba(SimpleNamespace(peft_type="LORA"), model, leaf)
                refused = False
            except ValueError:
                refused = True
            assert peft_refuses(model_type, f"model.layers.0.mixer.{leaf}") == refused


def test_a_list_naming_what_peft_refuses_is_an_error_before_launch(
    tiny_hybrid: Callable[[str], Path],
) -> None:
    model = _load(tiny_hybrid("falcon_h1"))
    with pytest.raises(HomelabError, match=r"'out_proj'.*falcon_h1") as err:
        lora_targets(model, ["in_proj", "out_proj"])
    assert "lora.target_modules" in str(err.value) and err.value.hint
    modules, params = lora_targets(model, "all-linear")
    assert params == [] and not any(m.endswith(("out_proj", "conv1d")) for m in modules)
    assert sum(m.endswith("mamba.in_proj") for m in modules) == 2  # both layers


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_a_lora_step_trains_on_the_reference_path(
    model_type: str, dtype: torch.dtype, tiny_hybrid: Callable[[str], Path]
) -> None:
    """No flash-linear-attention, mamba-ssm or causal-conv1d here: the torch reference kernels
    give a finite loss and a gradient on every adapter B matrix (A's are zero while B is)."""
    model = prepare_frozen_base(_load(tiny_hybrid(model_type), dtype), gradient_checkpointing=True)
    peft_model = add_lora(model, LORA)
    ids = torch.randint(3, 2000, (2, 24), generator=torch.Generator().manual_seed(0))
    out = peft_model(input_ids=ids, labels=ids, use_cache=False)
    assert torch.isfinite(out.loss)
    fp32 = tuple(getattr(model, "_keep_in_fp32_modules_strict", None) or ())  # routers: fp32
    base = {p.dtype for n, p in peft_model.named_parameters() if ".lora_" not in n
            and not any(k in n for k in fp32)}  # fmt: skip
    assert base == {dtype}
    out.loss.backward()
    grads = {n: p.grad for n, p in peft_model.named_parameters() if ".lora_B." in n}
    assert grads and all(g is not None and bool(g.abs().sum() > 0) for g in grads.values())
    opt = torch.optim.SGD([p for p in peft_model.parameters() if p.requires_grad], lr=0.5)
    opt.step()
    after = peft_model(input_ids=ids, labels=ids, use_cache=False).loss
    assert float(after) < float(out.loss)  # one step down the gradient lowers this loss


def test_an_adapter_loads_back_on_the_modules_it_was_trained_on(
    tiny_hybrid: Callable[[str], Path], tmp_path: Path
) -> None:
    """Ernie 4.5 MoE (a dense first layer, shared experts): saved and loaded back as `eval`,
    `export` and the replicas load it, the adapter gives the trained model's logits; peft's own
    v4 renaming would have put it on the routed experts."""
    from peft import PeftModel

    from homelab_dp.peft_targets import exact_targets

    folder = tiny_hybrid("ernie4_5_moe")
    peft_model = add_lora(_load(folder), LORA)
    assert not peft_model.peft_config["default"].target_parameters
    with torch.no_grad():  # non-zero B matrices: the adapters change the logits
        for name, param in peft_model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    ids = torch.randint(3, 2000, (1, 12), generator=torch.Generator().manual_seed(1))
    peft_model.eval()
    trained = peft_model(input_ids=ids).logits
    peft_model.save_pretrained(tmp_path / "adapter")
    with exact_targets(tmp_path / "adapter"):
        loaded = PeftModel.from_pretrained(_load(folder), tmp_path / "adapter").eval()
    assert sorted(_adapted(loaded)) == sorted(_adapted(peft_model))
    assert torch.allclose(loaded(input_ids=ids).logits, trained, atol=1e-6)
    renamed = PeftModel.from_pretrained(_load(folder), tmp_path / "adapter")  # without it
    assert sorted(_adapted(renamed)) != sorted(_adapted(peft_model))


def _qlora_load(folder: Path) -> nn.Module:
    """The QLoRA base as the worker loads it (`train.model.trainable_model.load_model`, adapters on)."""
    preset = preset_from_dict({"model": {"path": str(folder)}, "data": {"path": "unused.jsonl"},
                               "train": {"method": "qlora"}})  # fmt: skip
    resolved = Resolved(method="qlora", distribution="ddp", activation_checkpointing=False,  # type: ignore[arg-type]
                        device="cpu", world_size=1, dtype="fp32", micro_batch=1, grad_accum=1,
                        lr=1e-3)  # fmt: skip
    return load_model(preset, resolved, torch.device("cpu")).model


def _nf4_weights(model: nn.Module) -> tuple[int, dict[str, int]]:
    """What the loaded model holds in NF4, by logical size: every bitsandbytes ``Linear4bit``
    weight and every fused expert stack `quantize_experts` packed; and those outside the
    decoder layers by name."""
    import bitsandbytes as bnb

    linear4 = {n: m.in_features * m.out_features for n, m in model.named_modules()
               if isinstance(m, bnb.nn.Linear4bit)}  # fmt: skip
    fused = sum(
        math.prod(p.nf4_logical_shape)
        for m in model.modules() if is_fused_experts(m)
        for name, p in m.named_parameters(recurse=False) if name.endswith("_nf4")
    )  # fmt: skip
    outside = {n.removeprefix("base_model.model."): k for n, k in linear4.items()
               if ".layers." not in n}  # fmt: skip
    return sum(linear4.values()) + fused, outside


OUTSIDE_NF4 = {"gemma4_text": {"model.per_layer_model_projection"}}
"""Linears outside the decoder layers that QLoRA quantizes (every other family: none)."""


@pytest.mark.skipif(not nf4_works("cpu"), reason="bitsandbytes has no NF4 on this CPU")
@pytest.mark.parametrize("model_type", sorted(FAMILIES))
def test_the_plan_counts_in_4_bit_exactly_what_the_worker_quantizes(
    model_type: str, tiny_hybrid: Callable[[str], Path]
) -> None:
    """The plan's 4-bit parameters (`ModelSpec.quantizable_params`, from the census the planner
    runs) are what the worker's own QLoRA load puts in NF4: every ``Linear4bit`` weight, every
    fused expert stack, and the linears outside the decoder layers (Gemma 4's
    ``per_layer_model_projection``). Routers (Gemma 4's ``router.proj``, Qwen's
    ``shared_expert_gate``), Mamba's ``out_proj`` (mamba-ssm's fused kernel reads its weight)
    and lm_head stay 16-bit on both sides: one rule, `planning.model_layers.nf4_skip_modules`;
    the plan says so. The 4-bit base trains a step with its adapters."""
    folder = tiny_hybrid(model_type)
    model = _qlora_load(folder)
    in_nf4, outside = _nf4_weights(model)
    spec = census(folder)
    assert spec.quantizable_params == in_nf4
    assert set(outside) == OUTSIDE_NF4.get(model_type, set())
    assert spec.outer_quantized == sum(outside.values())
    quantized, kept = nf4_split(model)
    rule = nf4_skip_modules(model_type)
    for name in kept:  # the 16-bit linears are those the rule names, and only those
        assert any(f".{name}".endswith(k) for k in rule), name
    assert not [n for n in quantized if any(f".{n}".endswith(k) for k in rule)]
    assert "base_model.model.lm_head" in kept
    assert any(n.endswith(("in_proj", "in_proj_qkv", "q_proj")) for n in quantized)
    assert f"{len(quantized)} linears in NF4" in nf4_report(model)
    routers = [n for n, m in model.named_modules() if type(m) is nn.Linear and is_router(n, m)]
    assert all(n in kept for n in routers), routers
    reasons = " ".join(model_reasons(spec, "qlora"))
    assert "16-bit" in reasons
    mamba = model_type in PEFT_MAMBA_MODEL_TYPES
    assert any(n.endswith("out_proj") for n in kept) == mamba
    assert ("Mamba's out_proj" in reasons) == mamba
    # The 4-bit base trains: a finite loss and a gradient on every adapter's B matrix.
    ids = torch.randint(3, 2000, (1, 16), generator=torch.Generator().manual_seed(0))
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(p.grad is not None for n, p in model.named_parameters() if ".lora_B." in n)
