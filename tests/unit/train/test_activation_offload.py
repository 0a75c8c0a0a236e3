"""`train.parallelism.activation_offload`: the saved-tensor hooks move activations to the host, never weights.

On the tiny LLaMA as the worker loads it (`train.model.trainable_model.load_model`, the chunked loss head
installed): ``torch.autograd.graph.save_on_cpu`` copies every saved tensor, the frozen base
weights and lm_head among them; `ActivationOffload` keeps those on their device and moves the
rest, with bitwise the same training.
"""

from __future__ import annotations

import torch
from torch import nn

from homelab_dp.planning.memory.device_memory import TrainShape, budget, moved_activation_bytes
from homelab_dp.planning.model_spec import load_model_spec
from homelab_dp.train.model.loss import install_loss_head
from homelab_dp.train.parallelism.activation_offload import MIN_OFFLOAD_BYTES, ActivationOffload
from tests.conftest import ROOT
from tests.unit.train.test_lean_dtypes import CONFIG, HIDDEN, LAYERS, VOCAB, _load

INTER, KV = CONFIG["intermediate_size"], CONFIG["num_key_value_heads"] * CONFIG["head_dim"]
LINEAR_PARAMS = LAYERS * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * KV + 3 * HIDDEN * INTER)
B, S = 2, 256


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, VOCAB, (B, S), generator=g), torch.arange(S).repeat(B, 1)


def _forward(model: nn.Module, head: object, hooks: object) -> torch.Tensor:
    ids, pos = _batch()
    with hooks, head.targets(ids):  # type: ignore[attr-defined]
        return model(input_ids=ids, position_ids=pos, use_cache=False).logits


def test_weights_stay_and_only_activations_move() -> None:
    loaded = _load("lora", None)
    model = loaded.model.train()
    head = install_loss_head(model)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    # What save_on_cpu moves: every tensor autograd saves, counted at its own pack hook.
    saved: list[torch.Tensor] = []
    on_cpu = torch.autograd.graph.save_on_cpu(pin_memory=False)
    copy = on_cpu.pack_hook
    on_cpu.pack_hook = lambda t: (saved.append(t), copy(t))[1]
    _forward(model, head, on_cpu)
    everything = sum(t.numel() * t.element_size() for t in saved)
    assert any(t.untyped_storage().data_ptr() in storages for t in saved)

    off = ActivationOffload(model, pin=False)
    packed: list[tuple[torch.Tensor, object]] = []
    pack = off._pack
    off._pack = lambda t: packed.append((t, pack(t))) or packed[-1][1]  # type: ignore[method-assign]
    _forward(model, head, off.context()).backward()

    moved = [t for t, p in packed if isinstance(p, tuple)]
    kept = [t for t, p in packed if not isinstance(p, tuple)]
    weight_bytes = sum(
        t.numel() * t.element_size() for t in kept if t.untyped_storage().data_ptr() in storages
    )
    # The frozen linears (linear saves weight.t(), a view), lm_head and some adapters and norm
    # weights: save_on_cpu moves them all.
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    assert 4 * (LINEAR_PARAMS + VOCAB * HIDDEN) <= weight_bytes <= total
    assert not any(t.untyped_storage().data_ptr() in storages for t in moved)
    assert all(t.numel() * t.element_size() >= MIN_OFFLOAD_BYTES for t in moved)
    assert all(p.device.type == "cpu" for p in model.parameters())
    copied = sum(t.numel() * t.element_size() for t in moved)
    # A tensor saved twice (a linear's input by the base layer and its adapter) is copied once.
    assert off.shared_bytes > 0 and off.moved_bytes + off.shared_bytes == copied
    assert off.moved_bytes > 20e6
    assert off.moved_bytes + off.shared_bytes + off.kept_bytes == everything
    # save_on_cpu would move the weights too: at least their bytes more than the hooks.
    assert everything - off.moved_bytes >= weight_bytes


def test_autocast_copies_of_trainable_weights_stay() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    x = torch.randn(32, 64)
    off = ActivationOffload(model, pin=False)
    seen: list[tuple[torch.Tensor, bool]] = []
    pack = off._pack
    off._pack = lambda t: (seen.append((t, off.moves(t))), pack(t))[1]  # type: ignore[method-assign]
    with torch.autocast("cpu", dtype=torch.bfloat16), off.context():
        model(x).sum().backward()
    casts = [t for t, moves in seen if t.shape in ((64, 64),) and t.dtype == torch.bfloat16]
    assert casts and not any(off.moves(t) for t in casts)  # autocast's bf16 weights stay
    assert any(moves for _, moves in seen)  # the activations move
    assert off.moved_bytes + off.shared_bytes == sum(t.numel() * 2 for t, m in seen if m)


def _train(method: str, offload: bool, ac: bool) -> tuple[list[float], dict[str, torch.Tensor]]:
    loaded = _load(method, None, ac=ac)
    model = loaded.model.train()
    head = install_loss_head(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    losses = []
    for _ in range(2):
        hooks = ActivationOffload(model, pin=False).context() if offload else torch.enable_grad()
        loss = _forward(model, head, hooks)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=False)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def test_training_is_bitwise_the_same_with_the_hooks() -> None:
    for method, ac in (("lora", False), ("full", True)):
        plain, offloaded = _train(method, False, ac), _train(method, True, ac)
        assert plain[0] == offloaded[0], method
        assert plain[1].keys() == offloaded[1].keys()
        for name, w in plain[1].items():
            assert torch.equal(w, offloaded[1][name]), (method, name)


def _moved_by(method: str, ac: bool) -> tuple[int, int]:
    """(bytes the hooks move, bytes save_on_cpu moves) in one forward of the tiny model."""
    loaded = _load(method, None, ac=ac)
    model = loaded.model.train()
    head = install_loss_head(model)
    off = ActivationOffload(model, pin=False)
    _forward(model, head, off.context()).backward()
    everything = [0]
    on_cpu = torch.autograd.graph.save_on_cpu(pin_memory=False)
    copy = on_cpu.pack_hook
    on_cpu.pack_hook = lambda t: (everything.__setitem__(0, everything[0] + t.nbytes), copy(t))[1]
    _forward(model, head, on_cpu).backward()
    return off.moved_bytes, everything[0]


def test_the_plans_pcie_figure_is_what_the_hooks_move() -> None:
    """The planner's activation-offload traffic (`moved_activation_bytes`, what-if CUDA shape of
    the same run: fp32, no attention mask as these rows have none) against the bytes the hooks
    move on the CPU: within 25%, where save_on_cpu moves half as much again (the weights and
    every repeat of a tensor saved twice)."""
    spec = load_model_spec(ROOT / "assets" / "models" / "tiny-llama")
    for method, ac in (("lora", False), ("full", True)):
        shape = TrainShape(method=method, distribution="ddp", world_size=1, device="cuda",  # type: ignore[arg-type]
                           dtype="fp32", micro_batch=B, seq_len=S, activation_checkpointing=ac,
                           lora_r=8, attention="flash_attention_2", offload_activations=True)  # fmt: skip
        planned = moved_activation_bytes(spec, shape)
        assert budget(spec, shape).pcie_bytes_per_step == 2 * planned
        hooks, on_cpu = _moved_by(method, ac)
        assert abs(planned - hooks) <= 0.25 * hooks, (method, ac, planned, hooks)
        assert on_cpu > 1.25 * planned, (method, ac, planned, on_cpu)
