"""NF4 fused experts (nf4_quantization) on tiny random qwen3_moe, mixtral and gpt_oss
models built from their config classes: the 4-bit model computes what the model with
bitsandbytes' dequantized experts computes, forward and backward, dequantizes only the routed
experts (again in backward), stores 0.5 byte a value plus bitsandbytes' statistics, and a LoRA
step on top changes only the adapters."""

from __future__ import annotations

import copy
from pathlib import Path

import bitsandbytes as bnb
import bitsandbytes.functional as bnbf
import pytest
import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    GptOssConfig,
    MixtralConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from homelab_dp import nf4_quantization
from homelab_dp.nf4_quantization import (
    DEQUANT_GROUP_ELEMENTS,
    EXPERTS_IMPLEMENTATION,
    dequant_group_size,
    dequantize_expert,
    dequantize_expert_group,
    dequantize_experts,
    is_fused_experts,
    quantize_experts,
    quantized_bytes_per_expert,
)
from tests.conftest import ROOT, write_preset

COMMON = {"vocab_size": 96, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16}  # fmt: skip
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **COMMON,
        intermediate_size=96,
        moe_intermediate_size=48,
        num_experts=8,
        num_experts_per_tok=2,
    ),  # fmt: skip
    "mixtral": lambda: MixtralConfig(
        **COMMON, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2
    ),  # fmt: skip
    "gpt_oss": lambda: GptOssConfig(
        **COMMON,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    ),  # fmt: skip
}


def _model(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[family](), dtype=torch.float32)
    with torch.no_grad():  # visible biases (gpt-oss) and routers (zero-initialised in some)
        for name, p in model.named_parameters():
            if "bias" in name or "router" in name or "mlp.gate." in name:
                p.normal_(0, 0.2)
    return model.eval()


def _experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if is_fused_experts(m)]


def _reference(model: torch.nn.Module, quantized: torch.nn.Module) -> torch.nn.Module:
    """``model`` with each expert weight replaced by bitsandbytes' dequantization of it."""
    ref = copy.deepcopy(model)
    for mine, theirs in zip(_experts(quantized), _experts(ref), strict=True):
        for name, value in dequantize_experts(mine).items():
            getattr(theirs, name).data.copy_(value)
    return ref


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_forward_and_input_grads_equal_the_model_with_dequantized_experts(family: str) -> None:
    model = _model(family)
    quantized = copy.deepcopy(model)
    n = quantize_experts(quantized, torch.float32)
    experts = _experts(quantized)
    assert len(experts) == 2 and n == sum(
        p.numel() for m in _experts(model) for k, p in m.named_parameters() if k.endswith("proj")
    )
    assert quantized.config._experts_implementation == EXPERTS_IMPLEMENTATION
    ref = _reference(model, quantized)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
    x_q = quantized.get_input_embeddings()(ids).detach().requires_grad_()
    x_r = x_q.detach().clone().requires_grad_()
    out_q, out_r = quantized(inputs_embeds=x_q).logits, ref(inputs_embeds=x_r).logits
    torch.testing.assert_close(out_q, out_r, rtol=1e-5, atol=1e-5)
    # Not vacuous: the 4-bit experts are not the original ones.
    assert (out_q - model(inputs_embeds=x_r.detach()).logits).abs().max() > 1e-3
    out_q.square().mean().backward()
    out_r.square().mean().backward()
    assert x_q.grad is not None and x_q.grad.abs().max() > 0
    torch.testing.assert_close(x_q.grad, x_r.grad, rtol=1e-4, atol=1e-6)
    for m in experts:
        for name, p in m.named_parameters():
            if name.endswith("_nf4"):
                assert not p.requires_grad and p.grad is None, name


def test_an_expert_is_dequantized_as_bitsandbytes_linear4bit_dequantizes_it() -> None:
    model = _model("qwen3_moe")
    original = _experts(model)[0].down_proj.detach().clone()
    quantized = copy.deepcopy(model)
    quantize_experts(quantized, torch.float32)
    experts = _experts(quantized)[0]
    for e in (0, 5):
        p4 = bnb.nn.Params4bit(original[e].clone(), requires_grad=False, quant_type="nf4",
                               compress_statistics=True)._quantize("cpu")  # fmt: skip
        assert p4.blocksize == 64
        expected = bnbf.dequantize_4bit(p4.data, p4.quant_state)
        assert torch.equal(dequantize_expert(experts, "down_proj", e), expected)
        assert torch.equal(experts.down_proj_nf4[e], p4.data.reshape(-1))


def test_only_routed_experts_are_dequantized_and_again_in_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = _model("qwen3_moe")  # 8 experts, top-2, 2 layers
    quantize_experts(model, torch.float32)
    calls: list[tuple[int, ...]] = []
    real = bnbf.dequantize_4bit

    def counting(a: torch.Tensor, state: object) -> torch.Tensor:
        calls.append(tuple(state.shape))
        return real(a, state)

    monkeypatch.setattr(bnbf, "dequantize_4bit", counting)
    x = model.get_input_embeddings()(torch.tensor([[3]])).detach().requires_grad_()
    out = model(inputs_embeds=x).logits
    # One token: 2 experts a layer, 2 layers. gate_up's rows (64 values) fill whole absmax
    # blocks: both routed experts in one call (issue 32, point 7: before, one call each);
    # down's rows (48) do not: one expert a call.
    assert calls.count((2, 96, 64)) == 2 and calls.count((64, 48)) == 4 and len(calls) == 6
    out.sum().backward()
    assert len(calls) == 12  # dequantized again, nothing kept from the forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_group_of_experts_is_dequantized_in_one_call_bit_for_bit(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 32, point 7: routed experts' packed codes and scales gathered and dequantized as
    one tensor give each expert exactly what it gives alone, in one bitsandbytes call, and the
    group holds no more than the budget the plan counts."""
    model = _model("qwen3_moe")  # gate_up [8, 96, 64]: rows of 64 values
    quantize_experts(model, dtype)
    experts = _experts(model)[0]
    assert dequant_group_size(experts, "gate_up_proj") == 8
    assert dequant_group_size(experts, "down_proj") == 1  # rows of 48: one at a time
    calls: list[tuple[int, ...]] = []
    real = bnbf.dequantize_4bit

    def counting(a: torch.Tensor, state: object) -> torch.Tensor:
        calls.append(tuple(state.shape))
        return real(a, state)

    monkeypatch.setattr(bnbf, "dequantize_4bit", counting)
    group = dequantize_expert_group(experts, "gate_up_proj", [1, 4, 7])
    assert calls == [(3, 96, 64)] and group.dtype == dtype
    for j, e in enumerate([1, 4, 7]):
        assert torch.equal(group[j], dequantize_expert(experts, "gate_up_proj", e))
    # Large experts: the budget of values dequantized together, at least one expert.
    monkeypatch.setattr(nf4_quantization, "DEQUANT_GROUP_ELEMENTS", 3 * 96 * 64)
    assert dequant_group_size(experts, "gate_up_proj") == 3
    monkeypatch.setattr(nf4_quantization, "DEQUANT_GROUP_ELEMENTS", 100)
    assert dequant_group_size(experts, "gate_up_proj") == 1


def test_the_plan_counts_the_group_the_code_dequantizes() -> None:
    from homelab_dp.planning.memory import moe_memory

    assert moe_memory.DEQUANT_GROUP_ELEMENTS == DEQUANT_GROUP_ELEMENTS
    model = _model("qwen3_moe")
    quantize_experts(model, torch.float32)
    module = _experts(model)[0]
    size = dequant_group_size(module, "gate_up_proj")
    assert moe_memory.dequantized_group(8, 96 * 64) == size * 96 * 64


def test_packed_storage_is_half_a_byte_a_value_plus_the_statistics() -> None:
    model = _model("qwen3_moe")
    n = quantize_experts(model, torch.float32)
    experts = _experts(model)[0]
    sizes = {k: v.numel() * v.element_size() for k, v in
             [*experts.named_parameters(), *experts.named_buffers()]}  # fmt: skip
    # gate_up [8, 96, 64]: 6144 values an expert -> 3072 packed bytes, 96 absmax (a 64-block),
    # one float32 statistic (a 256-absmax block) and one float32 offset; code books shared.
    assert sizes["gate_up_proj_nf4"] == 8 * 3072
    assert sizes["gate_up_proj_absmax"] == 8 * 96
    assert sizes["gate_up_proj_absmax2"] == 8 * 4 and sizes["gate_up_proj_offset"] == 8 * 4
    assert sizes["gate_up_proj_code"] == 16 * 4 and sizes["gate_up_proj_code2"] == 256 * 4
    assert quantized_bytes_per_expert(96, 64) == 3072 + 96 + 4 + 4
    assert quantized_bytes_per_expert(4096, 2048) == 4194304 + 131072 + 512 * 4 + 4
    total = sum(v for k, v in sizes.items() if not k.endswith("code") and not k.endswith("code2"))
    assert total == 8 * (quantized_bytes_per_expert(96, 64) + quantized_bytes_per_expert(64, 48))
    assert n == 2 * 8 * (96 * 64 + 64 * 48)
    assert "gate_up_proj" not in dict(experts.named_parameters())  # the 32-bit weight is gone


def test_storage_in_the_compute_dtype_holds_the_same_bits() -> None:
    model = _model("mixtral")
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    quantize_experts(a, torch.bfloat16)
    quantize_experts(b, torch.bfloat16, storage=torch.bfloat16)
    ea, eb = _experts(a)[1], _experts(b)[1]
    assert eb.down_proj_nf4.dtype == torch.bfloat16
    assert torch.equal(eb.down_proj_nf4.view(torch.uint8), ea.down_proj_nf4)
    w = dequantize_expert(eb, "down_proj", 2)
    assert w.dtype == torch.bfloat16 and torch.equal(w, dequantize_expert(ea, "down_proj", 2))


def test_a_dense_model_is_left_alone() -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**COMMON, intermediate_size=96))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert quantize_experts(model, torch.float32) == 0
    assert model.config._experts_implementation != EXPERTS_IMPLEMENTATION
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_lora_step_on_attention_changes_only_the_adapters(family: str) -> None:
    model = _model(family)
    quantize_experts(model, torch.float32)
    for p in model.parameters():
        p.requires_grad_(False)
    model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                             init_lora_weights=False))  # fmt: skip
    model.train()
    before = {k: v.detach().clone() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(".lora_" in k for k, p in model.named_parameters() if p.requires_grad)
    opt = torch.optim.SGD(trainable, lr=0.1)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(2))
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    after = dict([*model.named_parameters(), *model.named_buffers()])
    changed = {k for k, v in before.items() if not torch.equal(v, after[k])}
    assert changed and all(".lora_" in k for k in changed)
    # Every adapter learnt, the first layer's too (its gradient crossed both MoE layers).
    assert changed == {k for k, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_the_fsdp_streamed_load_quantizes_the_experts_as_quantize_experts_does(
    family: str, tmp_path: Path
) -> None:
    """FSDP-QLoRA (train.quantized_load) on one gloo rank, in this process: built on meta,
    sharded, streamed from a checkpoint stored per expert (as the published ones are): every
    expert's packed values and state bit for bit those `quantize_experts` makes of the same
    weights, and a forward and backward run with the experts frozen."""
    from torch.distributed.fsdp import fully_shard

    from homelab_dp.presets.preset import load_preset
    from homelab_dp.runs.run_spec import Resolved
    from homelab_dp.train.model.quantized_load import build_on_meta

    model = _model(family)
    model.save_pretrained(tmp_path / "model")
    preset = load_preset(write_preset(tmp_path, "q", tmp_path / "model", ROOT / "assets" / "data" / "tiny-text.jsonl",
                                      method="qlora", distribution="fsdp-full", nproc=1))  # fmt: skip
    resolved = Resolved(method="qlora", distribution="fsdp-full", activation_checkpointing=False,
                        device="cpu", world_size=1, dtype="fp32", micro_batch=1, grad_accum=1,
                        lr=1e-3)  # fmt: skip
    expected = copy.deepcopy(model)
    quantize_experts(expected, torch.float32)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        loaded = build_on_meta(preset, resolved, torch.float32)
        for layer in loaded.decoder_layers:
            fully_shard(layer)
        fully_shard(loaded.model)
        loaded.materializer(loaded, torch.device("cpu"))
        got = _experts(loaded.model)
        assert len(got) == 2
        for mine, theirs in zip(got, _experts(expected), strict=True):
            for name, p in theirs.named_parameters():
                if name.endswith("_nf4"):  # stored in the compute dtype: the same bytes
                    full = mine.get_parameter(name).full_tensor()
                    assert full.dtype == torch.float32 and not full.requires_grad
                    assert torch.equal(full.view(torch.uint8), p)
            for name, b in theirs.named_buffers():
                assert torch.equal(getattr(mine, name), b), name
        ids = torch.randint(0, 96, (1, 12), generator=torch.Generator().manual_seed(3))
        loaded.model(input_ids=ids, labels=ids).loss.backward()
        grads = {k for k, p in loaded.model.named_parameters() if p.grad is not None}
        assert grads and all(".lora_" in k for k in grads)
    finally:
        dist.destroy_process_group()
