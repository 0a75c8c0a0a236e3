"""The last decoder layer's MLP on the target rows only (train/model/last_mlp_rows.py): the same
loss and every gradient as the whole MLP, fewer rows through it, nothing changed outside the
loss's targets, and refused where it would not be exact."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from homelab_dp.train.model.last_mlp_rows import (  # noqa: E402
    row_skip_refusal,
    skip_untargeted_rows,
)
from homelab_dp.train.model.loss import install_loss_head, token_loss_sum  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "assets" / "models" / "tiny-llama"
NO = {"checkpointing": False, "compiling": False, "sequence_split": False}


def _tiny_llama():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float64).train()


def _batch(vocab: int, b: int = 2, s: int = 24, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, s), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((b, 1), -100)], 1)
    labels[:, :6] = -100  # a prompt
    labels[1, 15:] = -100  # and a second sample's prompt
    return ids, labels


def _loss_and_grads(model, head, ids, labels):
    model.zero_grad(set_to_none=True)
    with head.targets(labels):
        out = model(input_ids=ids, use_cache=False).logits
    loss = token_loss_sum(out, labels, torch.float64, head)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _rows_into(module) -> list[int]:
    """Rows (tokens) each forward of ``module`` received, recorded by a hook."""
    seen: list[int] = []
    module.register_forward_hook(lambda m, args, out: seen.append(args[0].numel() // m.in_features))
    return seen


def test_the_loss_and_every_gradient_equal_the_whole_mlps_with_only_target_rows_computed() -> None:
    model = _tiny_llama()
    head = install_loss_head(model)
    layers = model.model.layers
    ids, labels = _batch(model.config.vocab_size)
    targets = int((labels != -100).sum())
    assert 0 < targets < labels.numel()
    whole = _loss_and_grads(model, head, ids, labels)

    assert row_skip_refusal(model, list(layers), head, **NO) is None
    skip_untargeted_rows(layers[-1], head)
    seen = _rows_into(layers[-1].mlp.down_proj)
    earlier = _rows_into(layers[0].mlp.down_proj)
    skipped = _loss_and_grads(model, head, ids, labels)
    assert seen == [targets] and earlier == [labels.numel()]  # only the last layer skips

    (loss_a, grads_a), (loss_b, grads_b) = skipped, whole
    assert abs(float(loss_a - loss_b)) <= 1e-12 * float(loss_b)
    assert grads_a.keys() == grads_b.keys() == {n for n, _ in model.named_parameters()}
    for name, ref in grads_b.items():
        assert float((grads_a[name] - ref).abs().max()) <= 1e-12 * float(ref.abs().max()), name

    # Outside the targets (generation, the packing check): every row, the model's own logits.
    seen.clear()
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
    assert seen == [labels.numel()] and logits.shape == (*ids.shape, model.config.vocab_size)


def _skipping():
    """The tiny model with the skip installed, the rows its last MLP receives, and a batch."""
    model = _tiny_llama()
    head = install_loss_head(model)
    skip_untargeted_rows(model.model.layers[-1], head)
    seen = _rows_into(model.model.layers[-1].mlp.down_proj)
    return model, head, seen, *_batch(model.config.vocab_size)


def test_a_block_without_targets_still_gives_every_parameter_its_zero_gradient() -> None:
    model, head, seen, ids, labels = _skipping()
    labels[:] = -100
    loss, grads = _loss_and_grads(model, head, ids, labels)
    assert seen == [0] and float(loss) == 0.0
    # DDP waits for every parameter's gradient in each backward: the skipped MLP's come too.
    mlp = {f"model.layers.{len(model.model.layers) - 1}.mlp.{p}.weight"
           for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    assert mlp <= grads.keys()
    assert all(float(grads[n].abs().max()) == 0.0 for n in mlp)


def test_labels_of_other_rows_leave_the_mlp_whole() -> None:
    model, head, seen, ids, labels = _skipping()
    with head.targets(labels[:, :10]), torch.no_grad():  # not this forward's rows
        model.model(input_ids=ids)
    assert seen == [ids.numel()]


def test_refused_where_it_would_not_be_exact() -> None:
    model = _tiny_llama()
    layers = list(model.model.layers)
    head = install_loss_head(model)
    assert "loss head" in row_skip_refusal(model, layers, None, **NO)
    for flag, words in [("checkpointing", "checkpointing"), ("compiling", "compile"),
                        ("sequence_split", "sequence")]:  # fmt: skip
        assert words in row_skip_refusal(model, layers, head, **{**NO, flag: True})
    assert "no mlp" in row_skip_refusal(model, [], head, **NO)


def test_a_moe_model_is_refused() -> None:
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    config = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32,
                            moe_intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, head_dim=8, num_experts=4,
                            num_experts_per_tok=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config)
    head = install_loss_head(model)
    assert "MoE" in row_skip_refusal(model, list(model.model.layers), head, **NO)
