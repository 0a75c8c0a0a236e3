"""QLoRA under FSDP2 and offload to host RAM: the memory model, the planner's choice, the
PCIe cost, the host budget and the bad input (the 70B-on-two-24-GiB-cards issue)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from homelab_dp.byte_units import GiB
from homelab_dp.errors import PresetError
from homelab_dp.planning.memory.device_memory import (
    NF4_BYTES_PER_PARAM,
    TrainShape,
    activation_bytes,
    budget,
    comm_bytes_per_step,
)
from homelab_dp.planning.memory.host_memory import (
    CHECKPOINT_BYTES_PER_PARAM,
    CUDA_HOST_RUNTIME_BYTES,
)
from homelab_dp.planning.memory.offload_cost import ASSUMED_MFU, PCIE_EFFICIENCY, plan_link
from homelab_dp.planning.model_spec import load_model_spec
from homelab_dp.planning.plan_hardware import PlanDevice, PlanHardware, parse_gpus_spec
from homelab_dp.planning.planner import measurement_key, plan, plan_largest_micro_batch, with_host
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.probe.hardware import GpuInfo, trained_pcie_link
from homelab_dp.render.plan import render_plan
from tests.conftest import ROOT

LLAMA2_70B = load_model_spec(ROOT / "assets/configs/llama-2-70b")
LLAMA3_70B = load_model_spec(ROOT / "assets/configs/meta-llama-3-70b")
Q = LLAMA2_70B.quantizable_params  # 80 × (2·8192² + 2·8192·1024 + 3·8192·28672) = 68.45B
ADAPTERS = LLAMA2_70B.lora_params(16)  # 80 × 16 × 161,792 = 207.1M (r 16, all-linear)


def _preset(**train):
    seq_len = train.pop("seq_len", 2048)
    return preset_from_dict({
        "model": {"path": "m"}, "data": {"path": "d", "seq_len": seq_len},
        "train": {"micro_batch": 1, "grad_accum": 1, **train},
    })  # fmt: skip


def _plan(gpus: str, spec=LLAMA2_70B, **train):
    return plan(spec, _preset(**train), parse_gpus_spec(gpus, 64 * GiB))


def _pow2(n: int) -> int:
    """The next power of two: what torch's caching host allocator pins for ``n`` bytes."""
    return 1 << (n - 1).bit_length()


def _shape(**kw) -> TrainShape:
    base = dict(method="qlora", distribution="fsdp-full", world_size=2, device="cuda",
                dtype="bf16", micro_batch=1, seq_len=2048, activation_checkpointing=True)  # fmt: skip
    return TrainShape(**{**base, **kw})  # type: ignore[arg-type]


def _option(c) -> tuple:
    return (c.method, c.distribution, c.activation_checkpointing, c.offload, c.offload_activations)


# -- the published shapes ---------------------------------------------------------------------


def test_the_70b_configs_have_the_published_sizes() -> None:
    # Llama-2-70B: 68,976,648,192 parameters (the model card's "70B"); Llama-3-70B's larger
    # vocabulary adds 2 × 96,256 × 8192 to the embeddings and lm_head: 70,553,706,496.
    assert LLAMA2_70B.params == 68_976_648_192
    assert LLAMA3_70B.params == 70_553_706_496
    assert (LLAMA2_70B.layers, LLAMA2_70B.kv_heads, LLAMA2_70B.tied_embeddings) == (80, 8, False)
    assert LLAMA3_70B.max_positions == 8192 and LLAMA2_70B.max_positions == 4096


# -- the memory model -------------------------------------------------------------------------


def test_qlora_under_fsdp_shards_the_packed_weights_and_keeps_the_quant_state_whole() -> None:
    spec, n = LLAMA2_70B, 2
    rest = (spec.params - Q) * 2  # embeddings, lm_head, norms in bf16
    packed, state = Q * 0.5, Q * (NF4_BYTES_PER_PARAM - 0.5)
    full = budget(spec, _shape())
    s = _shape()
    # Weights: this rank's shard of the packed weights, the 16-bit rest and the fp32 adapters,
    # plus the whole quantization state (1.09 GB: about 1/64 byte per weight).
    shard = (packed + rest + ADAPTERS * 4) / n
    # Loading, rank 0 also holds the tensor it streams, in bf16: the largest is the embedding
    # (32000 × 8192 × 2 bytes = 0.52 GB; the largest linear, 8192 × 28672, is 0.47 GB).
    streamed = spec.embedding_params * 2
    assert abs(full.phases["load"] - (shard + state + streamed)) <= 1
    assert 18e9 < shard < 18.1e9 and 1.08e9 < state < 1.09e9
    # Gathered: fsdp-full the root unit and two decoder layers, plus one dequantized linear
    # (2 × 8192 × 28672 × 2 bytes = 0.94 GB): 2.86 GB; grad-op the whole packed model.
    largest = 2 * 8192 * 28672 * 2
    layer = spec.linear_params_per_layer * 0.5 + ADAPTERS * 4 / 80 + spec.norm_params_per_layer * 2
    root = (spec.embedding_params + spec.lm_head_params + spec.final_norm_params) * 2
    assert abs(full.buffers - (root + 2 * layer + largest)) <= 1
    grad_op = budget(spec, replace(s, distribution="fsdp-grad-op"))
    assert abs(grad_op.buffers - (packed + rest + ADAPTERS * 4 + largest)) <= 1
    # The adapters' AdamW state is sharded too (8 bytes per trainable parameter / N).
    assert full.optimizer == int(ADAPTERS * 8 / n)
    # Under DDP nothing is sharded: every card holds the whole 4-bit model.
    ddp = budget(spec, replace(s, distribution="ddp"))
    assert ddp.weights == int(Q * NF4_BYTES_PER_PARAM + rest + ADAPTERS * 4)


def test_lora_under_fsdp_grad_op_keeps_the_whole_base_gathered() -> None:
    # reshard_after_forward=False: every unit stays gathered from forward to backward (the
    # whole 16-bit base, 138 GB), so offloading the shards cannot make it fit a 24 GiB card;
    # fsdp-full keeps the root unit (embeddings, lm_head) and two decoder layers.
    spec, base = LLAMA2_70B, LLAMA2_70B.params * 2
    grad_op = budget(spec, _shape(method="lora", distribution="fsdp-grad-op"))
    assert grad_op.phases["load"] == int(base / 2 + base + ADAPTERS * 4)
    full = budget(spec, _shape(method="lora", distribution="fsdp-full"))
    root = spec.embedding_params + spec.lm_head_params + spec.final_norm_params
    assert full.phases["load"] == int(base / 2 + (root + 2 * spec.layer_params) * 2 + ADAPTERS * 4)
    p = _plan("2x24GiB", method="lora", offload="params")
    assert p.fits and (p.chosen.distribution, p.chosen.offload) == ("fsdp-full", "params")


def test_qlora_under_fsdp_all_gathers_the_packed_weights_every_micro_step() -> None:
    spec = LLAMA2_70B
    gather = Q * 0.5 + (spec.params - Q) * 2 + ADAPTERS * 4
    ring = 1 / 2
    for dist, gathers in (("fsdp-grad-op", 1), ("fsdp-full", 2)):
        for accum in (1, 4):
            got = comm_bytes_per_step(spec, _shape(distribution=dist, grad_accum=accum))
            assert got == int(ring * (gathers * accum * gather + ADAPTERS * 4))
    assert comm_bytes_per_step(spec, _shape(distribution="ddp")) == int(2 * ring * ADAPTERS * 4)


def test_params_offload_leaves_the_gathered_units_and_the_quant_state_on_the_card() -> None:
    spec, s = LLAMA2_70B, _shape()
    on = budget(spec, s)
    off = budget(spec, replace(s, offload="params"))
    state = Q * (NF4_BYTES_PER_PARAM - 0.5)
    assert off.weights == int(state) and off.gradients == 0 and off.optimizer == 0
    assert off.buffers == on.buffers and off.activations == on.activations
    # Host: the shard, the adapters' gradient shard and their AdamW state (18.05 + 0.41 +
    # 0.83 GB = 19.3 GB), each pinned shard rounded up to a power of two on its own (torch's
    # caching host allocator): the MLP's packed 8192 × 28672 / 2 ranks (58.7 MB) pins 64 MiB,
    # the 32000 × 8192 embeddings' half 256 MiB: 21.4 GB. PCIe: the shard twice per
    # micro-step (fsdp-full gathers in forward and backward) and the gradient shard back once.
    shard = (Q * 0.5 + (spec.params - Q) * 2 + ADAPTERS * 4) / 2
    h, kv, inter, r = 8192, 1024, 28672, 16
    packed = 2 * _pow2(h * h // 4) + 2 * _pow2(h * kv // 4) + 3 * _pow2(h * inter // 4)
    adapters = (6 * _pow2(8 * h * 4) + _pow2(8 * inter * 4)  # A: r/2 rows × d_in fp32
                + 3 * _pow2(h // 2 * r * 4) + 2 * _pow2(kv // 2 * r * 4) + 2 * _pow2(inter // 2 * r * 4))  # fmt: skip
    pinned = 80 * (packed + adapters) + 2 * _pow2(32000 * h) + 161 * _pow2(h)
    grads = 80 * adapters
    assert off.offload_host_bytes == int(pinned + grads + ADAPTERS * 8 / 2)
    assert 21.3e9 < off.offload_host_bytes < 21.4e9
    assert abs(off.pcie_bytes_per_step - (2 * shard + ADAPTERS * 4 / 2)) <= 2
    grad_op = budget(spec, replace(s, distribution="fsdp-grad-op", offload="params", grad_accum=3))
    assert abs(grad_op.pcie_bytes_per_step - (3 * shard + ADAPTERS * 4 / 2)) <= 4


def test_optimizer_offload_pins_sixteen_and_moves_twelve_bytes_per_trainable_parameter() -> None:
    spec, s = LLAMA2_70B, _shape()
    b = budget(spec, replace(s, offload="optimizer"))
    local = ADAPTERS / 2
    assert b.optimizer == 0 and b.gradients == budget(spec, s).gradients
    # Host: AdamW's m and v, a copy of the fp32 weights and, during the step, of the gradients
    # (`HostAdamW`): 16 bytes per local trainable parameter, in four flat pinned buffers each
    # rounded up to a power of two (414 MB pins 512 MiB). PCIe: the gradient and weight
    # shards to the host and the updated weights back, 12.
    assert b.offload_host_bytes == 4 * _pow2(int(4 * local)) == 4 * 512 * 1024**2
    assert abs(b.pcie_bytes_per_step - 12 * local) <= 1


def test_activation_offload_keeps_about_one_layer_on_the_card() -> None:
    spec = LLAMA2_70B
    for ckpt in (False, True):
        s = _shape(activation_checkpointing=ckpt, grad_accum=2)
        # The activations and the loss head's saved tensors (the bf16 hidden rows, int64
        # labels and rows, fp32 log-sum-exp), not the weights.
        saved = activation_bytes(spec, s) + 2048 * (8192 * 2 + 8 + 8 + 4)
        b = budget(spec, replace(s, offload_activations=True))
        assert b.pcie_bytes_per_step == 2 * saved * 2  # out and back, every micro-step
        # Pinned, each tensor rounded to a power of two: with checkpointing every layer's input
        # is 2048 × 8192 × 2 bytes (32 MiB, no rounding); without, the MLP's 2048 × 28672
        # tensors pin 2048 × 32768.
        if ckpt:
            assert b.offload_host_bytes == saved
        else:
            assert saved * 1.05 < b.offload_host_bytes < saved * 1.1
        assert b.total < budget(spec, s).total
    # With checkpointing only each layer's input is saved: 80 × 8192 × 2 bytes × 2048 tokens
    # = 2.7 GB (bf16 residual under FSDP) plus the embeddings' outputs.
    ck = activation_bytes(spec, _shape())
    assert 2.68e9 < ck < 2.8e9


def test_offload_moves_nothing_on_the_cpu() -> None:
    spec = LLAMA2_70B
    s = _shape(device="cpu", dtype="fp32", world_size=2)
    plain = budget(spec, s)
    for kw in ({"offload": "params"}, {"offload_activations": True}):
        b = budget(spec, replace(s, **kw))
        assert b == plain and b.pcie_bytes_per_step == 0 and b.offload_host_bytes == 0
    # `HostAdamW` still makes its copies, in the same memory: the weights' from the first step
    # on (with the optimizer state), the gradients' during the step (measured on the tiny
    # model by `homelab-dp measure`: within 1% in each phase).
    b = budget(spec, replace(s, offload="optimizer"))
    local = ADAPTERS / 2 * 4
    assert b.pcie_bytes_per_step == 0 and b.offload_host_bytes == 0
    assert b.phases["load"] == plain.phases["load"]
    assert abs(b.optimizer - (plain.optimizer + local)) <= 1
    assert abs(b.phases["optimizer"] - (plain.phases["optimizer"] + 2 * local)) <= 2


# -- the planner on the 70B cases -------------------------------------------------------------


def test_llama2_70b_qlora_on_two_24gib_cards_fits_only_with_parameter_offload() -> None:
    p = _plan("2x24GiB", method="qlora")
    c = p.chosen
    assert p.fits and _option(c) == ("qlora", "fsdp-full", True, "params", False)
    # On the card: the quant state 1.09 GB, the gathered root unit and two layers plus one
    # dequantized linear 2.86 GB, the checkpointed activations with one recomputed layer
    # 3.95 GB less the block mask packed attention no longer makes (each sample attends
    # alone), and 0.75 GiB runtime + 10% fragmentation: 8.77 GiB.
    assert 8.5 * GiB < c.budget.total < 9.2 * GiB
    cost = c.offload_cost
    assert cost is not None and cost.assumed and cost.link == "PCIe 4.0 x16"
    # Pinned per rank: 21.4 GB (test above, each shard rounded); per step 2 × 18.05 + 0.41
    # = 36.5 GB over a PCIe 4.0 x16 link at 80% of 31.5 GB/s = 25.2 GB/s: 1.45 s.
    assert 21.3e9 < cost.host_bytes_per_device < 21.4e9
    assert 36.4e9 < cost.pcie_bytes_per_step < 36.6e9
    assert cost.pcie_seconds_per_step == pytest.approx(36.52e9 / (16 * 1.969e9 * 0.8), rel=1e-3)
    assert cost.slowdown is None  # a what-if card: its compute peak is not known
    # Without offload nothing fits: QLoRA-DDP holds the whole 4-bit model (49 GiB), FSDP
    # grad-op keeps it gathered (63 GiB), FSDP full needs 28 GiB.
    too_big = [r for r in p.reasons if r.startswith("Too big: QLoRA")]
    assert len(too_big) == 3
    assert "DDP" in too_big[0] and "49.0 GiB" in too_big[0]
    assert "FSDP full" in too_big[2] and "28.1 GiB" in too_big[2]
    (chosen,) = [r for r in p.reasons if r.startswith("Chosen:")]
    assert "only offload makes it fit" in chosen and "8.77 GiB per device" in chosen
    assert "19.9 GiB of pinned host RAM per device" in chosen
    assert "34.0 GiB over PCIe per step" in chosen and "≈ +1.4 s per step" in chosen
    # Every option without offload is listed, and the offloading one the plan uses.
    assert sum(1 for x in p.candidates if x.offload != "none") == 1
    assert _option(p.candidates[-1]) == _option(c)


def test_with_the_method_left_to_the_planner_the_70b_is_the_same_plan() -> None:
    # A full fine-tune with its parameters offloaded fits these cards too, but moves 414 GB
    # over PCIe per step (fp32 shards gathered twice, fp32 gradients back) against 36.5 GB.
    p = _plan("2x24GiB")
    assert p.fits and _option(p.chosen) == ("qlora", "fsdp-full", True, "params", False)
    assert any(r.startswith("Too big: full fine-tune with DDP") for r in p.reasons)
    full = _plan("2x24GiB", method="full")
    assert full.chosen.offload == "params" and full.chosen.method == "full"
    assert full.chosen.budget.pcie_bytes_per_step > 10 * p.chosen.budget.pcie_bytes_per_step


@pytest.mark.parametrize(
    ("spec", "gpus", "low", "high"),
    [
        # 2 × 48 GiB: shard 18.05 GB + state 1.09 + adapters' grads and AdamW 1.24 + buffers
        # 2.86 + activations 3.95 + overhead 0.75 GiB + 10%: 28.2 GiB of 45.6 usable.
        (LLAMA2_70B, "2x48GiB", 27.5, 29.0),
        # 4 × 24 GiB: the shard halves (9.0 GB), the rest stays: 18.5 GiB of 22.8.
        (LLAMA2_70B, "4x24GiB", 18.0, 19.0),
        # Llama-3-70B: 128,256 tokens make the root unit 4.2 GB gathered: 33.0 and 22.6 GiB.
        (LLAMA3_70B, "2x48GiB", 32.5, 33.5),
        (LLAMA3_70B, "4x24GiB", 22.0, 22.8),
    ],
)
def test_70b_qlora_fits_without_offload_on_more_memory(spec, gpus, low, high) -> None:
    p = _plan(gpus, spec=spec, method="qlora")
    c = p.chosen
    assert p.fits and _option(c) == ("qlora", "fsdp-full", True, "none", False)
    assert c.offload_cost is None
    assert low * GiB < c.budget.total < high * GiB
    # QLoRA-FSDP is chosen after QLoRA-DDP (every card the whole 4-bit model) is too big.
    assert any(r.startswith("Too big: QLoRA (4-bit base + LoRA) with DDP") for r in p.reasons)
    assert not any("offload" in r for r in p.reasons if r.startswith("Chosen:"))


def test_llama3_70b_on_two_24gib_cards_also_offloads_its_parameters() -> None:
    p = _plan("2x24GiB", spec=LLAMA3_70B, method="qlora")
    assert p.fits and _option(p.chosen) == ("qlora", "fsdp-full", True, "params", False)
    assert 11 * GiB < p.chosen.budget.total < 13 * GiB


def test_a_pinned_offload_is_respected() -> None:
    # Llama-2-70B fits 2 × 48 GiB without offload; pinned, the plan offloads anyway, and of
    # the options that fit takes the one that moves the fewest bytes over PCIe: FSDP grad-op
    # (the whole packed model stays gathered, 36 GB: 43.9 GiB with checkpointing) gathers the
    # shards once per micro-step, 18.5 GB, against fsdp-full's twice, 36.5 GB.
    p = _plan("2x48GiB", method="qlora", offload="params")
    assert p.fits and _option(p.chosen) == ("qlora", "fsdp-grad-op", True, "params", False)
    assert 43 * GiB < p.chosen.budget.total < 44.5 * GiB
    assert 18.4e9 < p.chosen.budget.pcie_bytes_per_step < 18.6e9
    assert any("offload = 'params'" in r and "pins" in r for r in p.reasons)
    assert all(c.offload == "params" for c in p.candidates if c.distribution.startswith("fsdp"))
    assert all(not c.supported for c in p.candidates if c.distribution in ("ddp", "zero1"))
    opt = _plan("2x48GiB", method="qlora", offload="optimizer")
    assert opt.fits and opt.chosen.offload == "optimizer"
    assert opt.chosen.budget.optimizer == 0
    acts = _plan("2x48GiB", method="qlora", offload_activations=True)
    assert acts.fits and acts.chosen.offload_activations and acts.chosen.offload == "none"


def test_offload_none_is_never_offloaded_and_the_advice_names_offload() -> None:
    p = _plan("2x24GiB", method="qlora", offload="none", offload_activations=False)
    assert not p.fits and p.chosen.offload == "none" and not p.chosen.offload_activations
    assert not any(c.offload != "none" or c.offload_activations for c in p.candidates)
    (line,) = [a for a in p.advice if a.startswith("Offload fits:")]
    assert "train.offload = 'params'" in line and "pinned host RAM" in line
    # offload = "none" alone still lets the planner offload the activations; here that is
    # not enough either (the weights alone are 18 GiB per card).
    q = _plan("2x24GiB", method="qlora", offload="none")
    assert not q.fits and q.chosen.offload == "none"


def test_nothing_offloads_while_something_fits_without_it() -> None:
    p = _plan("2x80GiB")
    assert p.fits and p.chosen.offload == "none" and not p.chosen.offload_activations


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("distribution", ["ddp", "zero1"])
@pytest.mark.parametrize("offload", ["params", "optimizer"])
def test_offload_with_a_pinned_ddp_is_refused(distribution, offload) -> None:
    # The preset itself refuses it (`presets.preset`); a preset made without that check (or
    # changed after it) is refused by the planner, naming the field and what to set.
    with pytest.raises(PresetError) as err:
        _plan("2x24GiB", distribution=distribution, offload=offload)
    assert err.value.exit_code == 2
    assert f"train.offload = {offload!r} needs FSDP" in err.value.message
    preset = _preset()
    preset = replace(
        preset, train=replace(preset.train, distribution=distribution, offload=offload)
    )
    with pytest.raises(PresetError) as err:
        plan(LLAMA2_70B, preset, parse_gpus_spec("2x24GiB", 0))
    assert err.value.exit_code == 2
    assert f"train.offload = {offload!r} needs FSDP" in err.value.message
    assert f"train.distribution = {distribution!r}" in err.value.message
    assert "train.distribution = 'fsdp-full'" in err.value.hint
    assert "train.offload = 'none'" in err.value.hint


def test_offload_on_one_device_is_refused() -> None:
    for gpus in ("24GiB", "cpu:1"):
        with pytest.raises(PresetError) as err:
            _plan(gpus, offload="params")
        assert "train.offload = 'params'" in err.value.message
        assert "two or more devices" in err.value.message and "--gpus 2x24GiB" in err.value.hint
    # Activations can go to the host from a single card.
    assert _plan("24GiB", spec=LLAMA2_70B, method="qlora", offload_activations=True)


def test_offload_in_fp16_is_refused_as_fsdp_is() -> None:
    with pytest.raises(PresetError) as err:
        _plan("2x24GiB@7.5", offload="params")
    assert "train.offload = 'params' cannot train in fp16" in err.value.message
    assert "FSDP needs bf16" in err.value.message
    # A pinned FSDP distribution is refused first, as before.
    with pytest.raises(PresetError) as err:
        _plan("2x24GiB@7.5", distribution="fsdp-full", offload="params")
    assert err.value.message.startswith("train.distribution = 'fsdp-full'")
    # In auto, fp16 leaves FSDP (and so parameter offload) out.
    p = _plan("2x24GiB@7.5", method="qlora")
    assert p.chosen.offload == "none" and p.chosen.distribution == "ddp"


def test_the_cli_says_error_and_hint(in_repo, capsys) -> None:
    from homelab_dp.cli import main

    rc = main(["plan", "--model", "assets/configs/llama-2-70b", "--gpus", "2x24GiB",
               "--set", "train.offload=params", "--set", "train.distribution=ddp"])  # fmt: skip
    err = capsys.readouterr().err
    assert rc == 2 and "error: train.offload = 'params' needs FSDP" in err and "hint:" in err


# -- the CPU ----------------------------------------------------------------------------------


def test_a_pinned_offload_on_the_cpu_budgets_the_same_and_costs_nothing() -> None:
    tiny = load_model_spec(ROOT / "assets/configs/smollm2-135m")
    plain = _plan("cpu:2:32GiB", spec=tiny, method="lora", distribution="fsdp-full", seq_len=256)
    for kw in ({"offload": "params"}, {"offload": "optimizer"}, {"offload_activations": True}):
        p = _plan(
            "cpu:2:32GiB", spec=tiny, method="lora", distribution="fsdp-full", seq_len=256, **kw
        )
        if "optimizer" not in kw.values():  # (HostAdamW's copies: the test above)
            assert p.chosen.budget == plain.chosen.budget
        cost = p.chosen.offload_cost
        assert cost is not None and cost.pcie_bytes_per_step == 0 and cost.slowdown == 1.0
        assert cost.host_bytes_per_device == 0 and "CPU" in cost.link


def test_auto_never_offloads_on_the_cpu() -> None:
    p = _plan("cpu:2:32GiB", method="qlora")  # 70B: nothing fits 16 GiB per process
    assert not p.fits and p.chosen.offload == "none" and not p.chosen.offload_activations
    assert not any(c.offload != "none" or c.offload_activations for c in p.candidates)


# -- the link and the slowdown ----------------------------------------------------------------


def test_the_link_comes_from_the_probe_and_the_slowdown_from_the_cards_peak() -> None:
    # NVML's current link drops at idle: the card's maximum is what it trains at.
    gpu = GpuInfo(0, "NVIDIA GeForce RTX 3090", 24 * GiB, pcie_gen=1, pcie_width=16,
                  pcie_gen_max=3, pcie_width_max=16)  # fmt: skip
    assert trained_pcie_link(gpu) == (3, 16)
    assert trained_pcie_link(replace(gpu, pcie_gen_max=None, pcie_width_max=None)) == (1, 16)
    card = PlanDevice("NVIDIA GeForce RTX 3090", 24 * GiB, (8, 6), pcie_gen=3, pcie_width=16)
    hw = PlanHardware("cuda", (card, card), source="probe")
    link = plan_link(hw)
    assert (link.words, link.assumed) == ("PCIe 3.0 x16", False)
    assert link.bytes_per_s == pytest.approx(16 * 0.985e9 * PCIE_EFFICIENCY)
    slow = plan_link(PlanHardware("cuda", (card, replace(card, pcie_gen=None)), source="probe"))
    assert (slow.words, slow.assumed) == ("PCIe 3.0 x16", True)  # the slower, yet one assumed
    p = plan(LLAMA2_70B, _preset(method="qlora"), hw)
    cost = p.chosen.offload_cost
    assert p.chosen.offload == "params" and cost.link == "PCIe 3.0 x16" and not cost.assumed
    # Compute: 424 GFLOP per token (QLoRA: forward 2N, the base's input gradient 2N, the
    # recomputed forward 2N; N = 68.7B) × 2048 tokens at 35% of 71 TFLOPS: about 35 s.
    assert cost.compute_seconds_per_step == pytest.approx(35.0, rel=0.02)
    assert ASSUMED_MFU == 0.35
    # 36.5 GB over PCIe 3.0 x16 at 80% of 15.8 GB/s: 2.9 s, 8% of the 35 s of compute.
    seconds = cost.pcie_bytes_per_step / (16 * 0.985e9 * 0.8)
    assert cost.slowdown == pytest.approx(1 + seconds / cost.compute_seconds_per_step)
    assert 2.85 < seconds < 2.95 and 1.07 < cost.slowdown < 1.10
    (chosen,) = [r for r in p.reasons if r.startswith("Chosen:")]
    assert f"~{cost.slowdown:.2f}× slower" in chosen


# -- the host budget --------------------------------------------------------------------------


def test_the_host_budget_holds_every_ranks_pinned_offload() -> None:
    preset = _preset(method="qlora")
    hw = parse_gpus_spec("2x24GiB", 64 * GiB)
    p = with_host(plan(LLAMA2_70B, preset, hw), preset, None)
    host = p.host
    assert host is not None and host.peak_phase == "train" and host.fits  # RAM not known
    pinned = p.chosen.offload_cost.host_bytes_per_device
    assert host.phases["train"] == (CUDA_HOST_RUNTIME_BYTES + pinned,
                                    2 * (CUDA_HOST_RUNTIME_BYTES + pinned))  # fmt: skip
    # Loading: only rank 0 reads the checkpoint, one 16-bit tensor (the 262M-weight
    # embeddings) and a packed linear at a time; rank 1 holds its runtime.
    first, total = host.phases["load"]
    tensor = LLAMA2_70B.embedding_params * CHECKPOINT_BYTES_PER_PARAM + 8192 * 28672 * 0.5
    assert first == int(CUDA_HOST_RUNTIME_BYTES + tensor)
    assert total - first == CUDA_HOST_RUNTIME_BYTES
    # 64 GiB of RAM holds 2 × 20 GiB of pinned memory: fits.
    roomy = with_host(plan(LLAMA2_70B, preset, hw), preset, 64 * GiB)
    assert roomy.fits and roomy.chosen.offload == "params"


def test_offload_the_ram_cannot_hold_is_not_chosen() -> None:
    preset = _preset(method="qlora")
    hw = parse_gpus_spec("2x24GiB", 64 * GiB)
    p = with_host(plan(LLAMA2_70B, preset, hw), preset, 32 * GiB)
    assert not p.fits
    assert p.chosen.offload != "params"  # needs 39.9 GiB: re-planned with the RAM known
    line = [r for r in p.reasons if r.startswith("Host RAM:")]
    assert line and "more than the 32.0 GiB available" in line[0]
    # The same with the RAM given to the planner itself.
    direct = plan(LLAMA2_70B, preset, hw, host_available=32 * GiB)
    assert direct.chosen.offload != "params" and not direct.chosen.fits


def test_qlora_under_ddp_still_reads_the_checkpoint_in_every_process() -> None:
    preset = _preset(method="qlora", distribution="ddp")
    p = with_host(plan(LLAMA2_70B, preset, parse_gpus_spec("2x48GiB", 0)), preset, None)
    first, total = p.host.phases["load"]
    assert total == 2 * first


# -- the finder, the calibration key, the JSON and the text -----------------------------------


def test_the_micro_batch_finder_reaches_the_offloading_options() -> None:
    preset = _preset(method="qlora", micro_batch=2, grad_accum=1)
    p = plan_largest_micro_batch(LLAMA2_70B, preset, parse_gpus_spec("2x24GiB", 0))
    assert p.fits and p.chosen.offload == "params" and p.fit is not None


def test_the_calibration_key_leaves_offload_out_unless_it_is_on() -> None:
    preset = _preset(method="qlora")
    hw = parse_gpus_spec("2x48GiB", 0)
    plain = plan(LLAMA2_70B, preset, hw).chosen
    assert "offload" not in measurement_key(LLAMA2_70B, preset, hw, plain)["shape"]
    off = replace(plain, offload="params")
    assert measurement_key(LLAMA2_70B, preset, hw, off)["shape"]["offload"] == "params"


def test_plan_json_has_the_offload_fields() -> None:
    p = _plan("2x24GiB", method="qlora")
    j = json.loads(json.dumps(p.to_json()))
    assert j["offload"] == "params" and j["offload_activations"] is False
    cost = j["offload_cost"]
    assert set(cost) >= {"host_bytes_per_device", "pcie_bytes_per_step", "pcie_seconds_per_step",
                         "slowdown", "link", "assumed"}  # fmt: skip
    assert cost["link"] == "PCIe 4.0 x16" and cost["assumed"] is True and cost["slowdown"] is None
    for c in j["candidates"]:
        assert {"offload", "offload_activations", "offload_cost"} <= set(c)
        assert (c["offload_cost"] is None) == (
            c["offload"] == "none" and not c["offload_activations"]
        )
    roomy = _plan("2x80GiB", method="qlora").to_json()
    assert roomy["offload"] == "none" and roomy["offload_cost"] is None


def test_the_plan_text_shows_the_offload() -> None:
    from rich.console import Console

    console = Console(width=400, record=True)
    console.print(render_plan(_plan("2x24GiB", method="qlora")))
    text = console.export_text()
    assert "offload params" in text  # the head
    line = [x for x in text.splitlines() if x.startswith("offload ")][0]
    assert "pinned host RAM per device" in line and "34.0 GiB over PCIe per step" in line
    assert "(PCIe 4.0 x16, assumed)" in line
    assert any("fsdp-full" in x and "params" in x and "yes" in x for x in text.splitlines())


def test_the_model_folders_need_only_config_json() -> None:
    for name in ("llama-2-70b", "meta-llama-3-70b"):
        assert sorted(p.name for p in Path(ROOT / "assets/configs" / name).iterdir()) == [
            "config.json"
        ]
