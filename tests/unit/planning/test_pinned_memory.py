"""`planning.memory.pinned_memory`: what pinned host memory torch hands out, and the planner's host line.

torch's caching host allocator rounds each pinned allocation up to the next power of two; the
plan's host line counts the rounding where the worker cannot avoid it (FSDP2's per-shard pins,
each saved activation) and once per kind for `HostAdamW`'s flat buffers.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from homelab_dp.planning.memory.device_memory import (
    TrainShape,
    activation_bytes,
    budget,
    moved_activation_bytes,
    pinned_activation_bytes,
    trainable_params,
)
from homelab_dp.planning.memory.pinned_memory import (
    fsdp_offload_pinned_bytes,
    fsdp_param_tensors,
    host_adamw_pinned_bytes,
    pinned_bytes,
    rounding,
)
from homelab_dp.planning.model_spec import load_model_spec
from tests.conftest import ROOT

CONFIGS = ["llama-2-70b", "meta-llama-3-8b", "mistral-7b-v0.1", "qwen2-0.5b", "smollm2-135m"]


def _shape(**kw: object) -> TrainShape:
    base = dict(method="full", distribution="fsdp-full", world_size=1, device="cuda",
                dtype="bf16", micro_batch=1, seq_len=2048)  # fmt: skip
    return TrainShape(**{**base, **kw})  # type: ignore[arg-type]


def test_a_pinned_request_rounds_up_to_a_power_of_two() -> None:
    assert [pinned_bytes(n) for n in (0, 1, 2, 3, 1024, 1025, 4096)] == [
        0,
        1,
        2,
        4,
        1024,
        2048,
        4096,
    ]
    assert pinned_bytes(1.05 * 2**30) == 2**31  # the 1.05 GiB shard pins 2 GiB
    assert pinned_bytes(2**30) == 2**30 and rounding(2**30) == 1.0
    assert rounding(3 * 2**20) == pytest.approx(4 / 3)
    # HostAdamW: one flat buffer per kind, each rounded once (not once per parameter).
    assert host_adamw_pinned_bytes(3 * 2**20) == 4 * 2**22
    assert host_adamw_pinned_bytes(3 * 2**20, kinds=3) == 3 * 2**22


@pytest.mark.parametrize("config", CONFIGS)
def test_fsdp_tensors_are_the_models_parameters(config: str) -> None:
    spec = load_model_spec(ROOT / "assets/configs" / config)
    full = fsdp_param_tensors(spec, _shape())
    assert sum(t.rows * t.row_bytes * t.count for t in full) == 4 * spec.params
    assert all(t.trainable for t in full)
    lora = _shape(method="lora", lora_r=8)
    tensors = fsdp_param_tensors(spec, lora)
    adapters = sum(t.rows * t.row_bytes * t.count for t in tensors if t.trainable)
    assert adapters == 4 * trainable_params(spec, lora)
    frozen = sum(t.rows * t.row_bytes * t.count for t in tensors if not t.trainable)
    assert frozen == 2 * spec.params  # the bf16 base


def test_fsdp_offload_pins_each_padded_shard_rounded() -> None:
    spec = load_model_spec(ROOT / "assets/configs/smollm2-135m")  # hidden 576, vocab 49152
    one = _shape(world_size=1)
    shards, grads = fsdp_offload_pinned_bytes(spec, one)
    tensors = fsdp_param_tensors(spec, one)
    assert shards == grads == sum(pinned_bytes(t.rows * t.row_bytes) * t.count for t in tensors)
    assert shards > 4 * spec.params  # 576-wide rows never land on a power of two
    # Over 3 ranks rank 0 holds ceil(rows / 3) rows of each tensor (the padded chunk): the
    # 49152 × 576 fp32 embedding's shard is 16384 rows, 37.7 MB, and pins 64 MiB.
    three = _shape(world_size=3)
    emb = tensors[0]
    assert (emb.rows, emb.row_bytes) == (49152, 576 * 4)
    assert pinned_bytes(16384 * 576 * 4) == 64 * 2**20
    s3, _ = fsdp_offload_pinned_bytes(spec, three)
    assert s3 == sum(pinned_bytes(-(-t.rows // 3) * t.row_bytes) * t.count for t in tensors)
    # The plan's host line counts the rounded shards and gradients and the (unpinned) AdamW
    # state, which torch's AdamW keeps in ordinary host memory.
    b = budget(spec, replace(_shape(world_size=3), offload="params"))
    assert b.offload_host_bytes == s3 + s3 + int(spec.params * 8 / 3)


def test_activation_offload_pins_each_saved_tensor_rounded() -> None:
    spec = load_model_spec(ROOT / "assets/configs/meta-llama-3-8b")  # 4096 / 14336
    for ckpt in (False, True):
        s = _shape(method="lora", distribution="ddp", activation_checkpointing=ckpt,
                   offload_activations=True)  # fmt: skip
        moved, pinned = moved_activation_bytes(spec, s), pinned_activation_bytes(spec, s)
        assert moved > activation_bytes(spec, s)  # the loss head's saved tensors too
        b = budget(spec, s)
        assert b.offload_host_bytes == pinned and b.pcie_bytes_per_step == 2 * moved
        if ckpt:  # each layer's input: 2048 × 4096 fp32, a power of two
            assert pinned == moved
        else:  # 2048 × 14336 MLP tensors pin 2048 × 16384
            assert moved * 1.05 < pinned < moved * 1.15
