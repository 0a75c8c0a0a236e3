"""Issue 23's planning acceptance, through the CLI, and the MoE memory model's parts.

The published-size configs are the ones `test_model_families.py` checks against transformers'
meta-device count (built with transformers' config classes and written as config.json); here
`homelab-dp plan --model DIR --json` on the recorded 2 × 24 GiB machine (2 × RTX 3090) must
give `model.active_params` and, for every model of at most 47B parameters, a plan that fits
(QLoRA or FSDP-QLoRA, or better). The unit tests below check what a MoE model, a frozen vision
tower and a pre-quantized checkpoint change in the budget, on hand-built specs.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from homelab_dp.planning.flops import flops_per_token, linear_matmul_params
from homelab_dp.planning.memory.device_memory import (
    NF4_BYTES_PER_PARAM,
    TrainShape,
    budget,
    chunked_loss,
)
from homelab_dp.planning.memory.host_memory import CUDA_HOST_RUNTIME_BYTES, host_budget
from homelab_dp.planning.memory.moe_memory import lora_param_count, moe_mlp_bytes
from homelab_dp.planning.memory.pinned_memory import fsdp_param_tensors
from homelab_dp.planning.model_spec import Experts, Linear, ModelSpec, spec_from_config
from homelab_dp.planning.plan_reasons import model_reasons
from tests.conftest import DATA, run_cli

transformers = pytest.importorskip("transformers")

from tests.unit.planning.test_model_families import PUBLISHED, _config_dict  # noqa: E402

FITTING = ("qlora", "lora", "full")
"""Methods from the smallest; a plan of any of them on 2 × 24 GiB counts."""


@pytest.fixture
def recorded_2x24(monkeypatch: pytest.MonkeyPatch) -> None:
    """The recorded answers of a machine with two 24 GiB RTX 3090s (NVLink)."""
    monkeypatch.setenv("HOMELAB_DP_FAKE_NVML", str(DATA / "nvml" / "2x3090-nvlink.json"))


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_model_plans_on_2x24gib(
    name: str, tmp_path: Path, recorded_2x24: None, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / name
    folder.mkdir()
    cfg = _config_dict(PUBLISHED[name])
    (folder / "config.json").write_text(json.dumps(cfg), encoding="utf-8")
    rc, out, err = run_cli(capsys, "plan", "--model", str(folder), "--json")
    assert rc == 0, err
    doc = json.loads(out)
    model = doc["model"]
    assert doc["hardware"]["kind"] == "cuda" and len(doc["hardware"]["devices"]) == 2
    assert [d["memory_bytes"] for d in doc["hardware"]["devices"]] == [24576 * 2**20] * 2
    spec = spec_from_config(cfg)
    assert model["params"] == spec.params and model["active_params"] == spec.active_params
    if spec.experts is not None:
        assert model["active_params"] < model["params"]
        assert any(r.startswith(f"MoE: {spec.experts.count} experts") for r in doc["reasons"])
    if model["params"] <= 47e9:
        assert doc["fits"] is True, doc["reasons"]
        assert doc["method"] in FITTING
        # What fits is within the card, overhead included.
        assert doc["per_device_bytes"]["total"] <= 24576 * 2**20
    if doc["method"] == "qlora":
        # Every quantizable weight (every routed expert) in NF4 beside the 16-bit rest, on
        # every card (DDP) or a share of it (FSDP).
        q = spec.quantizable_params
        whole = q * NF4_BYTES_PER_PARAM + (spec.params - q) * 2
        share = whole / (2 if doc["distribution"].startswith("fsdp") else 1)
        assert doc["per_device_bytes"]["weights"] >= 0.9 * share


# A tiny MoE model by hand: 4 layers, the first dense; 8 experts, top-2; one shared expert.
H, I_EXPERT, I_DENSE = 64, 32, 96
ATTN = (
    Linear("self_attn.q_proj", H, H),
    Linear("self_attn.k_proj", H, H // 2),
    Linear("self_attn.v_proj", H, H // 2),
    Linear("self_attn.o_proj", H, H),
)
MLP = (Linear("mlp.gate_proj", H, I_DENSE), Linear("mlp.up_proj", H, I_DENSE),
       Linear("mlp.down_proj", I_DENSE, H))  # fmt: skip
EXPERTS = Experts(
    count=8,
    top_k=2,
    linears=(
        Linear("mlp.experts.gate_up_proj", H, 2 * I_EXPERT),
        Linear("mlp.experts.down_proj", I_EXPERT, H),
    ),  # fmt: skip
    layers=3,
    router_params=8 * H,
    shared=(
        Linear("mlp.shared_expert.gate_proj", H, 48),
        Linear("mlp.shared_expert.up_proj", H, 48),
        Linear("mlp.shared_expert.down_proj", 48, H),
    ),  # fmt: skip
)
DENSE = ModelSpec(
    model_type="llama", layers=4, hidden=H, heads=4, kv_heads=2, head_dim=16,
    intermediate=I_DENSE, vocab=1000, max_positions=512, tied_embeddings=False,
    linears=ATTN + MLP, embedding_params=1000 * H, lm_head_params=1000 * H,
    norm_params_per_layer=2 * H, final_norm_params=H,
)  # fmt: skip
MOE = replace(DENSE, model_type="qwen2_moe", linears=ATTN, dense_mlp=MLP, experts=EXPERTS)


def _shape(method: str, dist: str = "ddp", **kw: object) -> TrainShape:
    base = dict(method=method, distribution=dist, world_size=2, device="cuda", dtype="bf16",
                micro_batch=2, seq_len=256)  # fmt: skip
    return TrainShape(**{**base, **kw})  # type: ignore[arg-type]


def test_lora_on_moe_adapts_attention_dense_mlp_and_shared_experts_by_default() -> None:
    r = 8
    attn = sum(r * (lin.d_in + lin.d_out) for lin in ATTN)
    dense = sum(r * (lin.d_in + lin.d_out) for lin in MLP)
    shared = sum(r * (lin.d_in + lin.d_out) for lin in EXPERTS.shared)
    assert lora_param_count(MOE, r, "all-linear") == 4 * attn + 1 * dense + 3 * shared
    # Naming "experts": lora_A in × r·E and lora_B r·E × out per fused weight, per MoE layer.
    routed = sum(r * 8 * (lin.d_in + lin.d_out) for lin in EXPERTS.linears)
    names = ["q_proj", "experts"]
    assert lora_param_count(MOE, r, names) == 4 * r * (H + H) + 3 * routed
    assert budget(MOE, _shape("lora", lora_r=r)).trainable_params == 4 * attn + dense + 3 * shared


def test_moe_budget_holds_every_expert_and_its_optimizer_state() -> None:
    b = budget(MOE, _shape("full", "fsdp-full", activation_checkpointing=True))
    trained = MOE.params  # every expert trained: fp32 master, gradient and AdamW m, v
    assert b.trainable_params == trained
    assert b.optimizer == pytest.approx(trained * 8 / 2, rel=1e-9)
    assert b.phases["optimizer"] >= trained * (4 + 4 + 8) / 2


def test_routed_tokens_activations_follow_top_k_and_expert_training() -> None:
    per_slot_trained = 2 * (4 * I_EXPERT + 2 * H) + 40  # bf16: 2 bytes per element
    per_slot_frozen = 2 * (3 * I_EXPERT + H) + 40
    shared = 2 * 2 * (48 + 48)  # gate, up, the activation and the product
    router = 4 * 8 + 4
    assert moe_mlp_bytes(MOE, 2, True) == 2 * per_slot_trained + router + shared
    assert moe_mlp_bytes(MOE, 2, False) == 2 * per_slot_frozen + router + shared
    top4 = replace(MOE, experts=replace(EXPERTS, top_k=4))
    full, full4 = budget(MOE, _shape("full")), budget(top4, _shape("full"))
    assert full4.activations - full.activations == 3 * 2 * per_slot_trained * 2 * 256


def test_lora_on_routed_experts_saves_their_folded_weights() -> None:
    plain = budget(MOE, _shape("lora"))
    named = budget(MOE, _shape("lora", lora_targets=("q_proj", "experts")))
    folded = 3 * 8 * (H * 2 * I_EXPERT + I_EXPERT * H) * 2  # W + B·A per MoE layer, bf16
    assert named.activations - plain.activations >= folded


def test_flops_use_the_active_parameters() -> None:
    active_matmul = (4 * sum(lin.d_in * lin.d_out for lin in ATTN)
                     + sum(lin.d_in * lin.d_out for lin in MLP)
                     + 3 * (2 * (H * 2 * I_EXPERT + I_EXPERT * H)
                            + sum(lin.d_in * lin.d_out for lin in EXPERTS.shared) + 8 * H)
                     + 1000 * H)  # fmt: skip
    assert linear_matmul_params(MOE) == active_matmul
    f = flops_per_token(MOE, method="full", activation_checkpointing=False, attention_span=1)
    assert f == pytest.approx(6 * active_matmul + 3 * 2 * 2 * 4 * 4 * 16)


def test_full_logits_follow_the_spec() -> None:
    assert chunked_loss(DENSE) and not chunked_loss(replace(DENSE, full_logits=True))
    chunked = budget(DENSE, _shape("lora"))
    full = budget(replace(DENSE, full_logits=True), _shape("lora"))
    assert full.logits >= 2 * 256 * 1000 * 12 > chunked.logits


def test_vision_tower_is_loaded_frozen() -> None:
    vision = 50_000
    wrapped = replace(DENSE, vision_params=vision)
    plain, b = budget(DENSE, _shape("full")), budget(wrapped, _shape("full"))
    assert b.trainable_params == plain.trainable_params
    assert b.weights - plain.weights == vision * 2  # bf16 weights only: no master copy
    assert b.optimizer == plain.optimizer
    assert any("Vision tower" in r for r in model_reasons(wrapped, "full"))


def test_fsdp_offload_pins_every_expert_shard() -> None:
    shape = _shape("full", "fsdp-full", offload="params")
    tensors = fsdp_param_tensors(MOE, shape)
    assert sum(t.rows * t.row_bytes * t.count for t in tensors) == MOE.params * 4


def test_reasons_say_experts_qlora_16_bit_and_pre_quantized() -> None:
    gptoss = replace(MOE, quantization="mxfp4")
    words = " ".join(model_reasons(gptoss, "qlora"))
    assert "MoE: 8 experts, top-k 2 in 3 of 4 layers" in words
    assert "stay 16-bit (the router" in words
    assert "mxfp4" in words and "re-quantized to NF4" in words
    assert "dequantized to the compute dtype" in " ".join(model_reasons(gptoss, "lora"))
    assert model_reasons(DENSE, "lora") == []


@pytest.mark.parametrize(
    ("preset", "method", "distribution", "offload"),
    [("qwen3-30b-a3b-qlora-2x24gb", "qlora", "ddp", "none"),
     ("gpt-oss-20b-lora-2x24gb", "lora", "fsdp-full", "params"),
     ("qwen3.5-35b-a3b-qlora-2x24gb", "qlora", "fsdp-full", "none")],
)  # fmt: skip
def test_moe_presets_fit_the_cards_they_name(
    preset: str, method: str, distribution: str, offload: str, in_repo: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    rc, out, err = run_cli(capsys, "plan", preset, "--gpus", "2x24GiB", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["fits"] is True and doc["host"]["fits"] is True
    assert (doc["method"], doc["distribution"]) == (method, distribution)
    assert doc["offload"] == offload
    assert doc["model"]["active_params"] < doc["model"]["params"] / 4
    if preset.startswith("gpt-oss"):  # MXFP4 on disk, bf16 in memory: the plan says so
        assert any(r.startswith("Pre-quantized checkpoint (mxfp4)") for r in doc["reasons"])


def test_gpt_oss_clamped_gate_saves_more_per_routed_slot() -> None:
    gptoss = replace(MOE, model_type="gpt_oss")
    slots = 2  # top-k
    assert moe_mlp_bytes(gptoss, 2, True) - moe_mlp_bytes(MOE, 2, True) == slots * 3 * I_EXPERT * 2
    assert (
        moe_mlp_bytes(gptoss, 2, False) - moe_mlp_bytes(MOE, 2, False) == slots * 3 * I_EXPERT * 2
    )


def test_qlora_load_holds_a_whole_expert_stack_on_the_host() -> None:
    wide = replace(EXPERTS, count=512)  # the stack [512, 2·32, 64] outgrows the embeddings
    spec = replace(MOE, experts=wide)
    stack = 512 * H * 2 * I_EXPERT
    assert stack > spec.embedding_params
    shape = _shape("qlora", "ddp")
    h = host_budget(spec, shape, budget(spec, shape))
    assert h.phases["load"][0] == CUDA_HOST_RUNTIME_BYTES + stack * 2  # read in 16 bits
    b = budget(spec, shape)
    assert b.buffers < 2 * stack * 2  # on the card: one expert dequantized at a time


def test_router_aux_loss_keeps_each_moe_layers_router_softmax() -> None:
    aux = replace(MOE, experts=replace(EXPERTS, aux_loss_coef=0.01))
    for ckpt in (False, True):
        shape = _shape("lora", activation_checkpointing=ckpt)
        extra = budget(aux, shape).activations - budget(MOE, shape).activations
        assert extra == 3 * 2 * 256 * 8 * 4  # MoE layers × tokens × experts × fp32


def test_qlora_with_adapters_on_nf4_experts_is_refused_before_launch() -> None:
    """Issue 32, point 6: under QLoRA the routed experts are NF4 stacks with no 3-D weight for
    peft, so adapters named on them would not exist: a pinned QLoRA is refused with a hint, and
    method = "auto" never picks QLoRA for such targets."""
    from homelab_dp.byte_units import GiB
    from homelab_dp.errors import PresetError
    from homelab_dp.planning.model_spec import load_model_spec
    from homelab_dp.planning.plan_hardware import parse_gpus_spec
    from homelab_dp.planning.planner import allowed_options, plan
    from homelab_dp.presets.preset import preset_from_dict
    from tests.conftest import ROOT

    spec = load_model_spec(ROOT / "assets/configs/qwen3-30b-a3b")

    def preset(method: str, targets):
        return preset_from_dict({"model": {"path": "m"}, "data": {"path": "d", "seq_len": 512},
                                 "train": {"method": method, "micro_batch": 1},
                                 "lora": {"target_modules": targets}})  # fmt: skip

    hw = parse_gpus_spec("2x80GiB", 256 * GiB)
    with pytest.raises(PresetError) as err:
        plan(spec, preset("qlora", ["all-linear", "experts"]), hw)
    assert "NF4" in err.value.message and "train.method = 'lora'" in err.value.hint
    assert plan(spec, preset("qlora", "all-linear"), hw).chosen is not None  # no expert targets
    methods = {m for m, _ in allowed_options(preset("auto", ["all-linear", "experts"]))}
    assert "qlora" not in methods and "lora" in methods
    assert "qlora" in {m for m, _ in allowed_options(preset("auto", "all-linear"))}


def test_qlora_budgets_one_dequantized_expert_not_the_stack() -> None:
    """Issue 32, point 7: the NF4 experts dequantize one expert at a time (again in backward),
    so the plan's dequantized buffer is one expert's weight, not the fused stack (Mixtral: one
    4096 × 14336 expert weight, not eight of them: 3.8 GB in bf16 was reserved)."""
    from homelab_dp.planning.memory.moe_memory import largest_dequantized, largest_quantized
    from homelab_dp.planning.model_spec import load_model_spec
    from tests.conftest import ROOT

    spec = load_model_spec(ROOT / "assets/configs/qwen3-30b-a3b")
    e = spec.experts
    assert e is not None and e.fused and e.count == 128
    one_expert = max(lin.d_in * lin.d_out for lin in e.linears)
    dense = max(lin.d_in * lin.d_out for lin in (*spec.linears, *spec.dense_mlp, *e.shared))
    assert largest_dequantized(spec) == max(one_expert, dense)
    assert largest_quantized(spec) == e.count * one_expert  # what the load reads whole


def test_qlora_budgets_the_group_of_small_experts_dequantized_together() -> None:
    """Issue 32, point 7: the NF4 experts dequantize small routed experts a group at a time
    (`nf4_quantization.dequant_group_size`), so the plan's dequantized buffer is the group:
    here all 8 experts' 64 x 64 gate_up (32768 values), more than the largest dense linear
    (64 x 96), where one expert at a time was counted before (6144, the dense MLP)."""
    from homelab_dp.planning.memory.moe_memory import (
        DEQUANT_GROUP_ELEMENTS,
        dequantized_group,
        largest_dequantized,
    )

    assert EXPERTS.fused and largest_dequantized(MOE) == 8 * H * 2 * I_EXPERT
    # A group never holds more than the budget unless one expert alone does.
    assert dequantized_group(128, 3 * DEQUANT_GROUP_ELEMENTS) == 3 * DEQUANT_GROUP_ELEMENTS
    assert dequantized_group(4096, 1000) == 1000 * (DEQUANT_GROUP_ELEMENTS // 1000)
    assert dequantized_group(128, 1000) == 128 * 1000  # at most every expert
