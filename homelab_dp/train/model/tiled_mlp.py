"""``train.tiled_mlp``: each decoder layer's MLP computed in tiles along the sequence.

ALST's TiledMLP idea, written for this worker. A dense MLP maps every token on its own, so it
may run over slices of the micro-batch's tokens one after another. `TiledMLPFunction`:

* forward: the tokens (every leading dimension flattened) cut into `mlp_tiles` tiles, each
  tile's MLP run under ``no_grad`` and the outputs concatenated; only the MLP's input is saved;
* backward: each tile recomputed with grad, one at a time, and differentiated at once
  (``torch.autograd.grad``) against the tile's input and the MLP's trainable parameters, so the
  intermediate tensors (gate, up, the activation, their product, their gradients) exist for one
  tile only. The parameters' gradients are summed over the tiles and returned as the gradients
  of the function's inputs, so autograd accumulates each parameter's gradient once per backward,
  as DDP's and FSDP2's hooks expect.

Exact: the same loss and gradients as the untiled MLP (within the rounding of a different
summation order; `tests/unit/train/test_tiled_mlp.py` checks fp64 to 1e-12). The recomputation
sees the random state the forward saw (LoRA's dropout masks repeat), and the autocast state.
Works with LoRA/QLoRA adapters inside the MLP (they are the MLP's trainable parameters) and
with activation checkpointing on or off (the checkpoint's recompute runs the tiled forward
again). A MoE block (``experts``) is left untiled, as the planner says
(`homelab_dp.planning.memory.mlp_tiles.tiled_mlp_refusal`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from homelab_dp.planning.memory.mlp_tiles import mlp_tiles


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


class TiledMLPFunction(torch.autograd.Function):
    """``forward(ctx, mlp, tiles, x, *params)``: ``mlp(x)`` computed ``tiles`` tiles at a time,
    recomputed tile by tile in backward; ``params`` are the MLP's trainable parameters."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, mlp: Callable[[torch.Tensor], torch.Tensor], tiles: int, x: torch.Tensor,
        *params: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        device = x.device.type
        ctx.mlp, ctx.tiles, ctx.params = mlp, tiles, params
        ctx.rng = _rng_state(x.device)
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(x)
        flat = x.reshape(-1, x.shape[-1])
        with torch.no_grad():
            out = torch.cat([mlp(t) for t in flat.tensor_split(tiles)])
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        (x,) = ctx.saved_tensors
        params: Sequence[torch.Tensor] = ctx.params
        want_x = ctx.needs_input_grad[2]
        flat, grads = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        dx = torch.empty_like(flat) if want_x else None
        dparams: list[torch.Tensor | None] = [None] * len(params)
        device = x.device
        enabled, dtype = ctx.autocast
        cpu_state, cuda_state = ctx.rng
        forked = [device.index or 0] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=forked, device_type=device.type):
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, device)
            row = 0
            tiles = zip(flat.tensor_split(ctx.tiles), grads.tensor_split(ctx.tiles), strict=True)
            for xt, gt in tiles:
                xt = xt.detach().requires_grad_(want_x)
                with torch.enable_grad(), torch.autocast(device.type, dtype, enabled=enabled):
                    out = ctx.mlp(xt)
                inputs = ([xt] if want_x else []) + list(params)
                got = torch.autograd.grad(out, inputs, gt, allow_unused=True)
                if want_x:
                    assert dx is not None
                    dx[row : row + xt.shape[0]] = got[0]
                    got = got[1:]
                for i, g in enumerate(got):
                    if g is not None:
                        dparams[i] = g if dparams[i] is None else dparams[i].add_(g)  # type: ignore[union-attr]
                row += xt.shape[0]
        return (None, None, dx.view_as(x) if dx is not None else None, *dparams)


def tile_mlp(mlp: nn.Module, hidden: int) -> None:
    """Make ``mlp`` (a decoder layer's dense MLP) run tiled while grad is on: its ``forward``
    replaced on the instance, so its parameters keep their names (checkpoints, adapters)."""
    original = mlp.forward

    def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        tokens = x.numel() // max(1, x.shape[-1]) if x.dim() else 0
        tiles = mlp_tiles(tokens, hidden)
        if args or kwargs or not torch.is_grad_enabled() or tiles < 2:
            return original(x, *args, **kwargs)
        params = [p for p in mlp.parameters() if p.requires_grad]
        return TiledMLPFunction.apply(original, tiles, x, *params)

    mlp.forward = forward  # type: ignore[method-assign]


def tile_mlps(layers: Sequence[nn.Module], hidden: int) -> int:
    """Tile the dense MLP (``layer.mlp``) of every decoder layer in ``layers``; a MoE block (one
    with ``experts``) and a layer without ``mlp`` stay as they are. Returns how many were tiled."""
    n = 0
    for layer in layers:
        mlp = getattr(layer, "mlp", None)
        if not isinstance(mlp, nn.Module) or hasattr(mlp, "experts") or hasattr(mlp, "router"):
            continue
        tile_mlp(mlp, hidden)
        n += 1
    return n
