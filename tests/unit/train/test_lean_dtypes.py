"""LoRA and QLoRA hold a frozen base in the compute dtype and fp32 adapters (`train.lora`).

The CPU computes in fp32; ``load_model(compute=torch.bfloat16)`` loads what a bf16 CUDA run holds,
on the CPU (bitsandbytes' 4-bit layers run there). peft's ``prepare_model_for_kbit_training``, the
preparation this replaces, is the third-party reference for the bytes saved.
"""

from __future__ import annotations

import json

import pytest
import torch

from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.model.lora import param_bytes
from homelab_dp.train.model.trainable_model import LoadedModel, load_model
from tests.conftest import ROOT

TINY = ROOT / "assets" / "models" / "tiny-llama"
CONFIG = json.loads((TINY / "config.json").read_text())
HIDDEN, VOCAB, LAYERS = CONFIG["hidden_size"], CONFIG["vocab_size"], CONFIG["num_hidden_layers"]
# Embeddings and the untied lm_head, plus two norms per layer and the final one.
NOT_LINEAR = 2 * VOCAB * HIDDEN + (2 * LAYERS + 1) * HIDDEN
LINEARS_PER_LAYER = 7  # q, k, v, o, gate, up, down


def _load(method: str, compute: torch.dtype | None, ac: bool = False) -> LoadedModel:
    preset = preset_from_dict(
        {"model": {"path": str(TINY)}, "data": {"path": "unused.jsonl"}, "lora": {"r": 8}}
    )
    resolved = Resolved(method=method, distribution="ddp", activation_checkpointing=ac,  # type: ignore[arg-type]
                        device="cpu", world_size=1, dtype="fp32", micro_batch=2, grad_accum=1,
                        lr=1e-3)  # fmt: skip
    torch.manual_seed(0)
    return load_model(preset, resolved, torch.device("cpu"), compute=compute)


def _is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_base_stays_in_the_compute_dtype_and_adapters_are_fp32(method: str) -> None:
    import bitsandbytes as bnb
    from peft import prepare_model_for_kbit_training

    loaded = _load(method, torch.bfloat16)
    model = loaded.model
    four_bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(four_bit) == (LAYERS * LINEARS_PER_LAYER if method == "qlora" else 0)
    packed = {id(m.weight) for m in four_bit}
    sixteen = 0
    for name, p in model.named_parameters():
        if _is_adapter(name):
            assert p.dtype == torch.float32 and p.requires_grad, name
        elif id(p) in packed:
            assert type(p).__name__ == "Params4bit" and p.dtype == torch.uint8, name
            assert not p.requires_grad, name
        else:
            assert p.dtype == torch.bfloat16 and not p.requires_grad, name
            sixteen += p.numel()
    base = model.get_base_model()
    assert base.get_input_embeddings().weight.dtype == torch.bfloat16
    assert base.get_output_embeddings().weight.dtype == torch.bfloat16
    linear = sum(m.weight.numel() for n, m in base.named_modules() if n.endswith(".base_layer"))
    assert sixteen == NOT_LINEAR + (0 if method == "qlora" else linear)
    adapters = param_bytes(model, trainable=True)
    assert adapters == loaded.trainable_params * 4 > 0

    # peft's preparation casts every 16-bit parameter that is not 4-bit to fp32: 2 more bytes each.
    lean = param_bytes(model)
    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    assert param_bytes(model) - lean == 2 * sixteen


def test_cpu_runs_are_unchanged_fp32_everywhere() -> None:
    """compute_dtype is fp32 on the CPU: peft's preparation would cast nothing more."""
    from peft import prepare_model_for_kbit_training

    model = _load("qlora", None).model
    floats = [p for p in model.parameters() if p.dtype.is_floating_point]
    assert floats and all(p.dtype == torch.float32 for p in floats)
    before = {n: (p.dtype, p.requires_grad) for n, p in model.named_parameters()}
    lean = param_bytes(model)
    prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    assert param_bytes(model) == lean
    assert {n: p.dtype for n, p in model.named_parameters()} == {
        n: d for n, (d, _) in before.items()
    }
    assert {n for n, (_, g) in before.items() if g} == {
        n for n in before if _is_adapter(n)
    }  # the same trainable set as peft's (which also freezes all but the adapters)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_adapters_get_gradients_under_bf16_autocast_with_checkpointing(method: str) -> None:
    """Non-reentrant checkpointing needs no input that requires grad: layer 0's adapters learn."""
    loaded = _load(method, torch.bfloat16, ac=True)
    model = loaded.model
    assert model.get_base_model().is_gradient_checkpointing
    with torch.no_grad():  # lora_B starts at zero, which leaves lora_A's gradient zero
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.02)
    # Inside the block (its own hooks stay outside the checkpoint), and a pre-hook: the
    # recomputation stops once the tensors backward needs exist, before the MLP returns.
    calls = []
    loaded.decoder_layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids, use_cache=False)
    assert out.logits.dtype == torch.bfloat16  # the lm_head ran in the compute dtype
    # No hook makes the embeddings' output require grad: layer 0's input needs no gradient.
    embeddings = model.get_base_model().get_input_embeddings()
    assert not embeddings._forward_hooks and not embeddings(ids).requires_grad
    out.loss.backward()
    assert len(calls) == 2  # the forward and the recomputation in backward
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * LAYERS * LINEARS_PER_LAYER
    for name, g in grads.items():
        assert g is not None and g.dtype == torch.float32, name
        assert torch.isfinite(g).all() and g.abs().sum() > 0, name
    first = [n for n in grads if ".layers.0." in n]
    assert len(first) == 2 * LINEARS_PER_LAYER
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad and p.grad is not None]
    assert frozen == []


# -- fp16 compute (Turing): the residual stream in fp32 --------------------------------------------


def _residual_outliers(model: torch.nn.Module) -> None:
    """A stand-in for a bf16-native family's residual outliers: the embeddings' output sits near
    fp16's top (6e4, still an fp16 number) and layer 0's attention adds ~8e3 to every channel,
    past 65504. In fp32 nothing overflows."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with torch.no_grad():
        base.get_input_embeddings().weight.fill_(6e4)
        attn = base.model.layers[0].self_attn
        for linear, value in ((attn.v_proj, 0.05), (attn.o_proj, 10.0)):
            getattr(linear, "base_layer", linear).weight.fill_(value)


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_fp16_keeps_embeddings_and_norms_in_fp32(method: str) -> None:
    import bitsandbytes as bnb

    from homelab_dp.train.model.lora import is_norm

    model = _load(method, torch.float16).model
    base = model.get_base_model()
    assert base.get_input_embeddings().weight.dtype == torch.float32
    norms = [m for m in base.modules() if is_norm(m)]
    assert len(norms) == 2 * LAYERS + 1
    assert all(m.weight.dtype == torch.float32 for m in norms)
    assert base.get_output_embeddings().weight.dtype == torch.float16  # a matmul: fp16
    for name, m in base.named_modules():
        if name.endswith(".base_layer") and not isinstance(m, bnb.nn.Linear4bit):
            assert m.weight.dtype == torch.float16, name
    # bf16 (Ampere and newer) stays lean: nothing widened.
    lean = _load(method, torch.bfloat16).model.get_base_model()
    assert lean.get_input_embeddings().weight.dtype == torch.bfloat16


def test_fp16_residual_stream_does_not_overflow_where_fp16_would() -> None:
    """The real model under fp16 autocast: an fp16 residual overflows (NaN loss), the fp32 one
    that LoRA now keeps under fp16 trains on, its adapters getting finite gradients."""
    from peft import LoraConfig, get_peft_model

    ids = torch.randint(3, VOCAB, (2, 16), generator=torch.Generator().manual_seed(2))
    fixed = _load("lora", torch.float16).model
    _residual_outliers(fixed)
    with torch.autocast("cpu", dtype=torch.float16):
        out = fixed(input_ids=ids, labels=ids, use_cache=False)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    grads = [p.grad for p in fixed.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)

    from transformers import AutoModelForCausalLM

    raw = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float16)  # the old lean LoRA
    raw = get_peft_model(raw, LoraConfig(r=8, target_modules="all-linear"))
    _residual_outliers(raw)
    with torch.autocast("cpu", dtype=torch.float16):
        assert not torch.isfinite(raw(input_ids=ids, labels=ids, use_cache=False).loss)


def test_the_plan_counts_the_fp32_embeddings_and_norms_of_an_fp16_run() -> None:
    """A LoRA or QLoRA base under fp16 keeps its embeddings and norms in fp32
    (`residual_in_fp32`): the memory model's weights grow by 2 bytes for each of them, against
    the same run in bf16, and by nothing for a full fine-tune (fp32 master weights already)."""
    from homelab_dp.planning.memory.device_memory import budget
    from homelab_dp.planning.memory.train_shape import TrainShape
    from homelab_dp.planning.model_spec import load_model_spec
    from tests.conftest import ROOT

    spec = load_model_spec(ROOT / "assets" / "configs" / "qwen2-0.5b")
    upcast = 2 * (
        spec.embedding_params + spec.final_norm_params + spec.norm_params_per_layer * spec.layers
    )
    assert upcast > 0
    for method, extra in (("lora", upcast), ("qlora", upcast), ("full", 0)):
        weights = {
            dtype: budget(
                spec,
                TrainShape(
                    method=method,
                    distribution="ddp",
                    world_size=1,
                    device="cuda",
                    dtype=dtype,
                    micro_batch=1,
                    seq_len=512,
                    grad_accum=1,
                ),
            ).weights
            for dtype in ("bf16", "fp16")
        }
        assert weights["fp16"] - weights["bf16"] == extra, method
