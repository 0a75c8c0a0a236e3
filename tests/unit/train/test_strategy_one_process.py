"""ddp and zero1 on one process: no DDP wrapper, no reducer, the plain optimizer (fused AdamW: no
host read in its step); `batches.to_device`; the sample order's slices. Training results on
one process are `test_equivalence.py`'s references."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from homelab_dp.measure.memcheck import single_rank_group
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.loop.device_copy import to_device
from homelab_dp.train.model.trainable_model import load_model
from homelab_dp.train.parallelism.strategy import (
    _no_forward_buffer_sync,
    build_optimizer,
    wrap_model,
)

ROOT = Path(__file__).resolve().parents[3]
DEMO_MODEL = ROOT / "assets" / "models" / "tiny-llama"


def _build(tmp_path: Path, distribution: str) -> tuple[Any, Any, Any]:
    preset = preset_from_dict({
        "model": {"path": str(DEMO_MODEL)},
        "data": {"path": str(tmp_path / "unused.jsonl"), "seq_len": 16},
        "train": {"method": "full", "distribution": distribution, "micro_batch": 2,
                  "grad_accum": 2, "max_steps": 1},
    })  # fmt: skip
    resolved = Resolved(method="full", distribution=distribution,  # type: ignore[arg-type]
                        activation_checkpointing=False, device="cpu", world_size=1,
                        dtype="fp32", micro_batch=2, grad_accum=2, lr=1e-3)  # fmt: skip
    loaded = load_model(preset, resolved, torch.device("cpu"))
    return preset, resolved, loaded


def _loss(model: Any, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


@pytest.mark.parametrize("distribution", ["ddp", "zero1"])
def test_one_process_has_no_wrapper_and_accumulates_plainly(
    distribution: str, tmp_path: Path
) -> None:
    with single_rank_group(tmp_path):
        preset, resolved, loaded = _build(tmp_path, distribution)
        strategy = wrap_model(loaded, resolved, torch.device("cpu"))
        assert strategy.model is loaded.model and strategy.inner is loaded.model
        assert not isinstance(strategy.model, DistributedDataParallel)
        assert strategy.ddp is None and not strategy.grads_in_buckets
        assert strategy.unseen_bucket_bytes() == 0
        optimizer = build_optimizer(strategy, preset.train, resolved.lr, torch.device("cpu"))
        assert type(optimizer) is torch.optim.AdamW  # zero1: nothing to shard on one process

        gen = torch.Generator().manual_seed(0)
        a, b = (torch.randint(0, 2048, (2, 16), generator=gen) for _ in range(2))
        with strategy.accumulate(final=False):
            _loss(strategy.model, a).backward()
        with strategy.accumulate(final=True):
            _loss(strategy.model, b).backward()
        accumulated = [p.grad.clone() for p in strategy.trainable]
        strategy.zero_grad(optimizer)
        assert all(p.grad is None for p in strategy.trainable)  # freed: no bucket keeps them
        _loss(strategy.model, a).backward()
        _loss(strategy.model, b).backward()
        for got, p in zip(accumulated, strategy.trainable, strict=True):
            assert torch.equal(got, p.grad)
        _fused_step_checks(optimizer)  # the CPU's AdamW: fused, no host read (issue 33)


def test_the_per_forward_buffer_broadcast_is_switched_off_by_this_torchs_name() -> None:
    import inspect

    params = inspect.signature(DistributedDataParallel.__init__).parameters
    ((name, value),) = _no_forward_buffer_sync().items()
    assert value is False and name in params
    assert name == (
        "forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"
    )


def test_to_device_leaves_host_tensors_alone_on_the_cpu() -> None:
    t = torch.arange(6).reshape(2, 3)
    assert to_device(t, torch.device("cpu")) is t


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_device_pins_and_copies_without_blocking_on_cuda() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.arange(1 << 20, dtype=torch.int64).reshape(1024, 1024)
    before = t.clone()
    out = to_device(t, dev)
    assert out.device == dev and not t.is_pinned()  # the caller's tensor is not touched
    torch.cuda.synchronize(dev)
    assert torch.equal(out.cpu(), before)
    assert to_device(out, dev) is out  # already there


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the calls that read a tensor's value into Python (a host sync on a GPU)."""

    READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.count += getattr(func, "__name__", "") in self.READS
        return func(*args, **(kwargs or {}))


def _fused_step_checks(optimizer: torch.optim.Optimizer) -> None:
    """Issue 33: the CPU's AdamW was the foreach one, which reads every parameter's step count
    with ``.item()`` each step; the fused kernel reads none and updates as torch's reference
    (single-tensor) AdamW does, to fp32 rounding."""
    assert all(g["fused"] is True for g in optimizer.param_groups)
    start = {id(p): p.detach().clone() for g in optimizer.param_groups for p in g["params"]}
    copies = {k: v.clone().requires_grad_() for k, v in start.items()}
    ref_opt = torch.optim.AdamW(
        [{**{k: v for k, v in g.items() if k not in ("params", "fused", "foreach")},
          "params": [copies[id(p)] for p in g["params"]]} for g in optimizer.param_groups],
        foreach=False,
    )  # fmt: skip
    pairs = [(p, copies[id(p)]) for g in optimizer.param_groups for p in g["params"]]
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        for p, r in pairs:
            p.grad = torch.randn(p.shape, generator=gen)
            r.grad = p.grad.clone()
        with _HostReads() as reads:
            optimizer.step()
        ref_opt.step()
        assert reads.count == 0
    moved = max(float((p - start[id(p)]).abs().max()) for p, _ in pairs)
    differ = max(float((p - r).abs().max()) for p, r in pairs)
    assert moved > 1e-3 and differ < 1e-6  # 3 steps of lr 1e-3 move weights by ~3e-3


def test_sample_order_indices_slice_each_epoch_as_the_position_by_position_order() -> None:
    """Issue 33: a step's blocks are slices of the epoch permutations (one tensor, no read per
    position), the same blocks position p // n, p % n names, across epoch boundaries too."""
    from homelab_dp.train.parallelism.strategy import SampleOrder

    order, fresh = SampleOrder(7, 3), SampleOrder(7, 3)
    for start in range(0, 24, 5):
        for count in (0, 1, 6, 7, 8, 15):
            want = [int(fresh.perm(p // 7)[p % 7]) for p in range(start, start + count)]
            got = order.indices(start, count)
            assert got.dtype == torch.long and got.tolist() == want
            assert order.blocks(start, count) == want
            assert order.rows(start, count) == want  # the loop's: a read once an epoch
    assert sorted(order.indices(14, 7).tolist()) == list(range(7))  # one whole epoch
    assert order.indices(14, 7).tolist() != order.indices(7, 7).tolist()  # reshuffled
