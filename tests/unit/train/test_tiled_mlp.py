"""`train.tiled_mlp`: the MLP in tiles along the sequence, exact, and the peak it removes as planned.

On the tiny LLaMA as the worker loads it (`train.model.trainable_model.load_model`, the chunked loss
head installed), one model per case: first in fp32 the live tensor bytes (`train.loop.memtrack`'s
`LiveTensors`, what `homelab-dp measure` counts) of a forward and backward untiled and tiled
against the memory model's budget of both, then in fp64 the loss and every gradient, untiled and
tiled, to 1e-12.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from homelab_dp.planning.memory.device_memory import TrainShape, budget
from homelab_dp.planning.memory.mlp_tiles import mlp_tile_tokens, mlp_tiles
from homelab_dp.planning.model_spec import load_model_spec
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.loop.memtrack import LiveTensors
from homelab_dp.train.model.loss import install_loss_head
from homelab_dp.train.model.tiled_mlp import tile_mlp, tile_mlps
from homelab_dp.train.model.trainable_model import load_model
from homelab_dp.train.parallelism.activation_offload import ActivationOffload
from tests.conftest import ROOT

TINY = ROOT / "assets" / "models" / "tiny-llama"
B, S = 1, 512
"""One 512-token sequence: 4 tiles of the tiny model's 128 hidden size."""


def _load(method: str, ac: bool) -> tuple[nn.Module, list[nn.Module], object]:
    preset = preset_from_dict({"model": {"path": str(TINY)}, "data": {"path": "unused.jsonl"},
                               "lora": {"r": 8, "dropout": 0.0}})  # fmt: skip
    resolved = Resolved(method=method, distribution="ddp", activation_checkpointing=ac,  # type: ignore[arg-type]
                        device="cpu", world_size=1, dtype="fp32", micro_batch=B, grad_accum=1,
                        lr=1e-3)  # fmt: skip
    torch.manual_seed(0)
    loaded = load_model(preset, resolved, torch.device("cpu"))
    model = loaded.model.train()
    return model, loaded.decoder_layers, install_loss_head(model)


def _untile(layers: list[nn.Module]) -> None:
    for layer in layers:
        layer.mlp.__dict__.pop("forward", None)  # the class's forward again


def _step(
    model: nn.Module,
    head: object,
    seq_len: int = S,
    *,
    measure: bool = False,
    offload: bool = False,
) -> tuple[float, dict[str, torch.Tensor], int]:
    """(loss, every trainable gradient, live tensor peak of the backward: 0 unless
    ``measure``); ``offload``: the saved activations through `ActivationOffload`'s hooks."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 2048, (B, seq_len), generator=g)
    pos = torch.arange(seq_len).repeat(B, 1)
    live = LiveTensors()
    live.track(model.parameters(), "weights")
    with live if measure else contextlib.nullcontext():
        hooks = ActivationOffload(model, pin=False).context() if offload else torch.enable_grad()
        with head.targets(ids), hooks:  # type: ignore[attr-defined]
            loss = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        live.reset_peak()
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return loss.item(), grads, live.peak if measure else 0


def _planned(method: str, ac: bool, tiled: bool) -> int:
    spec = load_model_spec(TINY)
    shape = TrainShape(method=method, distribution="ddp", world_size=1, device="cpu",  # type: ignore[arg-type]
                       dtype="fp32", micro_batch=B, seq_len=S, activation_checkpointing=ac,
                       lora_r=8, attention="homelab_packed", tiled_mlp=tiled)  # fmt: skip
    return budget(spec, shape).phases["backward"]


CASES = [("lora", False), ("full", True)]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: f"{c[0]}-ckpt{int(c[1])}")
def measured(request: pytest.FixtureRequest) -> Iterator[dict]:
    method, ac = request.param
    model, layers, head = _load(method, ac)
    out = {"method": method, "ac": ac}
    out["fp32"] = _step(model, head, measure=True)
    assert tile_mlps(layers, 128) == len(layers) == 4
    out["fp32_tiled"] = _step(model, head, measure=True)
    _untile(layers)
    model.double()
    out["fp64"] = _step(model, head)
    tile_mlps(layers, 128)
    out["fp64_tiled"] = _step(model, head)
    # offloaded activations too (with checkpointing: the layer inputs) through the hooks
    out["fp64_tiled_offloaded"] = _step(model, head, offload=True)
    yield out


def test_the_same_loss_and_gradients_in_fp64(measured: dict) -> None:
    (loss, grads, _), (tiled_loss, tiled_grads, _) = measured["fp64"], measured["fp64_tiled"]
    assert abs(loss - tiled_loss) <= 1e-12 * abs(loss)
    assert grads.keys() == tiled_grads.keys() and grads
    for name, g in grads.items():
        diff = (g - tiled_grads[name]).abs().max().item()
        assert diff <= 1e-12 * max(1.0, g.abs().max().item()), (name, diff)


def test_tiled_with_offloaded_activations_is_bitwise_tiled(measured: dict) -> None:
    (loss, grads, _), (off_loss, off_grads, _) = (
        measured["fp64_tiled"],
        measured["fp64_tiled_offloaded"],
    )
    assert loss == off_loss and grads.keys() == off_grads.keys()
    assert all(torch.equal(g, off_grads[n]) for n, g in grads.items())


def test_the_peak_it_removes_is_the_planned_one(measured: dict) -> None:
    """The backward's live-tensor peak falls by what the plan says, within 10% (measured: the
    same bytes without checkpointing, 0.5% apart with it)."""
    method, ac = measured["method"], measured["ac"]
    removed = measured["fp32"][2] - measured["fp32_tiled"][2]
    planned = _planned(method, ac, False) - _planned(method, ac, True)
    assert removed > 0 and planned > 0
    assert abs(removed - planned) <= 0.10 * removed, (removed, planned)


def test_qlora_adapters_inside_the_mlp_get_the_same_gradients() -> None:
    model, layers, head = _load("qlora", False)
    loss, grads, _ = _step(model, head, 128)
    tile_mlps(layers, 32)  # 4 tiles of 32 tokens: the 4-bit CPU matmuls are slow
    tiled_loss, tiled_grads, _ = _step(model, head, 128)
    assert abs(loss - tiled_loss) <= 1e-6 * abs(loss)
    mlp = [n for n in grads if ".mlp." in n and "lora_" in n]
    assert mlp and grads.keys() == tiled_grads.keys()
    for name, g in grads.items():
        assert torch.allclose(g, tiled_grads[name], rtol=1e-4, atol=1e-5 * g.abs().max().item())


def test_dropout_masks_repeat_in_the_recompute() -> None:
    """An MLP with dropout: the backward's recompute sees the forward's random state, so the
    gradients are those of the very masks the forward drew (tile by tile, as the forward did)."""
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 48), nn.SiLU(), nn.Dropout(0.5), nn.Linear(48, 16)).double()
    x = torch.randn(2, 40, 16, dtype=torch.float64, requires_grad=True)
    tiles = mlp_tiles(80, 16)
    assert tiles == 5 and mlp_tile_tokens(80, 16) == 16
    torch.manual_seed(7)
    ref = torch.cat([mlp(t) for t in x.reshape(-1, 16).tensor_split(tiles)]).view(2, 40, 16)
    ref.pow(2).sum().backward()
    want = x.grad.clone(), [p.grad.clone() for p in mlp.parameters()]
    x.grad = None
    mlp.zero_grad(set_to_none=True)
    tile_mlp(mlp, 16)
    torch.manual_seed(7)
    out = mlp(x)
    assert torch.equal(out, ref.detach())
    torch.manual_seed(123)  # the backward restores the forward's state, whatever happened since
    out.pow(2).sum().backward()
    after = torch.rand(1)
    assert torch.allclose(x.grad, want[0], atol=1e-12)
    for p, g in zip(mlp.parameters(), want[1], strict=True):
        assert torch.allclose(p.grad, g, atol=1e-12)
    torch.manual_seed(123)
    assert torch.equal(after, torch.rand(1))  # and leaves the random state as it found it


def test_no_grad_and_a_single_tile_run_the_mlp_as_it_is() -> None:
    mlp = nn.Linear(8, 8).double()
    tile_mlp(mlp, 8)
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    assert mlp(x).grad_fn.name() != "TiledMLPFunctionBackward"  # 3 tokens: one tile
    x = torch.randn(40, 8, dtype=torch.float64, requires_grad=True)
    assert "TiledMLPFunction" in mlp(x).grad_fn.name()
    with torch.no_grad():
        assert mlp(x).grad_fn is None
