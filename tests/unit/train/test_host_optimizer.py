"""`train.parallelism.host_optimizer.HostAdamW`: one flat host buffer per kind of state, AdamW's steps.

torch's caching host allocator rounds each pinned allocation up to a power of two; the state is
one buffer per kind (each parameter's tensor a view), so it rounds once per kind, as the planner
counts (`planning.memory.pinned_memory`). On the CPU nothing is pinned, but the layout is the same.
"""

from __future__ import annotations

import torch

from homelab_dp.train.parallelism.host_optimizer import HostAdamW

SHAPES = [(64, 48), (48,), (3, 5, 7), (1000,)]


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]


def _grads(params: list[torch.nn.Parameter], step: int) -> None:
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def _storages(tensors: list[torch.Tensor]) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in tensors}


def test_each_kind_of_state_is_one_flat_buffer() -> None:
    params = _params()
    opt = HostAdamW([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}])
    _grads(params, 0)
    opt.step()
    total = sum(p.numel() for p in params)
    for kind in ("exp_avg", "exp_avg_sq"):
        views = [opt.state[p][kind] for p in params]
        assert len(_storages(views)) == 1, kind  # one buffer for both groups
        assert views[0].untyped_storage().nbytes() == 4 * total
        assert [v.shape for v in views] == [p.shape for p in params]
    avg, sq = (opt.state[params[0]][k] for k in ("exp_avg", "exp_avg_sq"))
    assert _storages([avg]) != _storages([sq])
    weights = opt._views["weights"]
    assert len(_storages([weights[p] for p in params])) == 1
    assert "grads" not in opt._views  # on the CPU the gradients' copy lives through the step


def test_steps_are_torchs_adamw() -> None:
    mine, ref = _params(), _params()
    opt = HostAdamW(mine, lr=1e-2, weight_decay=0.1)
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.1, fused=True)
    for step in range(3):
        _grads(mine, step)
        _grads(ref, step)
        opt.step()
        torch_opt.step()
    for a, b in zip(mine, ref, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(opt.state[a]["exp_avg_sq"], torch_opt.state[b]["exp_avg_sq"])

    # A resume loads into the flat buffers and goes on as torch's AdamW does.
    again = _params(seed=7)
    for a, b in zip(again, mine, strict=True):
        a.data.copy_(b.data)
    resumed = HostAdamW(again, lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(torch_opt.state_dict())
    assert len(_storages([resumed.state[p]["exp_avg"] for p in again])) == 1
    _grads(again, 3)
    _grads(ref, 3)
    resumed.step()
    torch_opt.step()
    for a, b in zip(again, ref, strict=True):
        assert torch.equal(a, b)
