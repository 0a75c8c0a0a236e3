"""Chunked cross-entropy (train/model/loss.py): the same loss and gradients as full cross-entropy,
installed in place of lm_head without changing parameters, names or tying, and far less memory.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from homelab_dp.planning.memory.device_memory import chunk_peak_bytes, chunk_tokens  # noqa: E402
from homelab_dp.train.loop.memtrack import LiveTensors  # noqa: E402
from homelab_dp.train.model.loss import (  # noqa: E402
    ChunkedLossHead,
    chunked_cross_entropy,
    install_loss_head,
    token_loss_sum,
    unsupported_reason,
)

ROOT = Path(__file__).resolve().parents[3]
TINY = ROOT / "assets" / "models" / "tiny-llama"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest difference relative to the largest magnitude of the reference."""
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def _labels(shape: tuple[int, ...], vocab: int, seed: int = 1) -> torch.Tensor:
    """Random targets with -100 on a prefix of each row and on rows 8..31 of the flat view."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, vocab, shape, generator=g)
    flat = y.view(-1)
    flat[8:32] = -100  # with chunk 8: whole chunks of ignored tokens
    flat[::7] = -100
    return y


# ------------------------------------------------------------------ the function alone


@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-12), (torch.float32, 2e-6)])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_and_gradients_equal_full_cross_entropy(dtype, bound, bias) -> None:
    g = torch.Generator().manual_seed(0)
    b_, s, h, v = 3, 23, 16, 97  # 69 tokens: chunk 8 does not divide it
    hidden = torch.randn(b_, s, h, generator=g, dtype=dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(v, generator=g, dtype=dtype).requires_grad_() if bias else None
    labels = _labels((b_, s), v)
    inputs = [t for t in (hidden, weight, b) if t is not None]

    ref = F.cross_entropy(F.linear(hidden, weight, b).flatten(0, 1), labels.flatten(),
                          ignore_index=-100, reduction="sum")  # fmt: skip
    ref_grads = torch.autograd.grad(ref, inputs)
    got = chunked_cross_entropy(hidden, weight, b, labels, chunk=8)
    grads = torch.autograd.grad(got, inputs)

    assert got.shape == () and got.dtype == dtype
    assert abs(float(got.detach() - ref.detach())) / float(ref) < bound
    for mine, theirs in zip(grads, ref_grads, strict=True):
        assert mine.dtype == theirs.dtype and mine.shape == theirs.shape
        assert _rel(mine, theirs) < bound
    # ignored positions get exactly zero gradient
    ignored = (labels == -100).view(-1)
    assert ignored.sum() > 20 and grads[0].view(-1, h)[ignored].abs().max() == 0


def test_every_token_ignored_is_a_zero_loss_with_zero_gradients() -> None:
    hidden = torch.randn(2, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.full((2, 5), -100)
    loss = chunked_cross_entropy(hidden, weight, None, labels, chunk=4)
    loss.backward()
    assert float(loss) == 0.0
    assert hidden.grad is not None and weight.grad is not None  # DDP needs every gradient
    assert hidden.grad.abs().max() == 0 and weight.grad.abs().max() == 0


def test_grad_output_scales_the_gradients() -> None:
    hidden = torch.randn(9, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(13, 8, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 13, (9,))
    (chunked_cross_entropy(hidden, weight, None, labels, chunk=4) * 0.25).backward()
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (F.cross_entropy(hidden @ weight.T, labels, reduction="sum") * 0.25).backward()
    assert _rel(ref_h, hidden.grad) < 1e-12 and _rel(ref_w, weight.grad) < 1e-12


def test_autocast_runs_the_matmuls_in_the_autocast_dtype_like_nn_linear() -> None:
    """CPU bf16 autocast stands in for CUDA's: same bf16 logits, fp32 loss, fp32 master grads."""
    g = torch.Generator().manual_seed(3)
    lin = nn.Linear(32, 300)
    hidden = torch.randn(4, 40, 32, generator=g).requires_grad_()
    labels = _labels((4, 40), 300)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = lin(hidden)
        got = chunked_cross_entropy(hidden, lin.weight, lin.bias, labels, chunk=16)
    assert logits.dtype == torch.bfloat16 and got.dtype == torch.float32
    ref = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), reduction="sum")
    ref_grads = torch.autograd.grad(ref, (hidden, lin.weight, lin.bias))
    grads = torch.autograd.grad(got, (hidden, lin.weight, lin.bias))
    # The forward is the same bf16 logits reduced in fp32: equal up to summation order.
    assert abs(float(got - ref)) / float(ref) < 1e-5
    for mine, theirs in zip(grads, ref_grads, strict=True):
        assert mine.dtype == theirs.dtype == torch.float32
        assert _rel(mine, theirs) < 2e-2  # bf16 products; ours are summed in fp32
    # Without autocast the same call is fp32 throughout and far closer to the fp32 truth.
    exact = chunked_cross_entropy(hidden, lin.weight, lin.bias, labels, chunk=16)
    assert abs(float(exact - got)) / float(exact) < 1e-2


def test_chunk_tokens_targets_two_to_the_24_logits() -> None:
    assert chunk_tokens(128256) == 128
    assert chunk_tokens(32000) == 520
    assert chunk_tokens(2048) == 8192
    assert chunk_tokens(10**9) == 8
    assert all(chunk_tokens(v) % 8 == 0 for v in (50257, 151936, 256000))


@pytest.mark.parametrize("bf16", [False, True])
def test_peak_memory_is_a_small_fraction_of_three_full_fp32_logits(bf16: bool) -> None:
    """32k vocabulary, 2 × 2048 tokens: measured live bytes, against chunk_peak_bytes too.

    bf16: CPU autocast, the shape of the CUDA bf16 path (16-bit logits and a cast weight)."""
    g = torch.Generator().manual_seed(0)
    n, h, v = 4096, 32, 32000
    hidden = torch.randn(2, n // 2, h, generator=g).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.05).requires_grad_()
    labels = torch.randint(0, v, (2, n // 2), generator=g)
    tracker = LiveTensors()
    tracker.track([hidden, weight, labels], "weights")
    tracker.reset_peak()
    base = tracker.current
    with tracker, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = chunked_cross_entropy(hidden, weight, None, labels)
        forward_peak = tracker.peak - base
        tracker.reset_peak()
        loss.backward()
        backward_peak = tracker.peak - base
    full = n * v * 4 * 3
    assert max(forward_peak, backward_peak) < 0.1 * full, (forward_peak, backward_peak, full)
    m = chunk_peak_bytes(v, h, n, 2 if bf16 else 4, weight_bytes=4, hidden_bytes=4)
    # The formula is what the planner budgets: an upper bound, and close.
    for measured, model in ((forward_peak, m["saved"] + m["forward"]),
                            (backward_peak, m["saved"] + m["backward"])):  # fmt: skip
        assert 0.85 * model <= measured <= model, (measured, model)


def test_token_loss_sum_passes_the_heads_loss_through_or_computes_the_full_one() -> None:
    logits = torch.randn(2, 5, 7, dtype=torch.float64)
    labels = torch.randint(0, 7, (2, 5))
    labels[0, 0] = -100
    full = token_loss_sum(logits, labels, torch.float32, None)
    ref = F.cross_entropy(logits.float().view(-1, 7), labels.view(-1), reduction="sum")
    assert full.dtype == torch.float32 and float(full) == float(ref)
    head = ChunkedLossHead(nn.Linear(3, 7))
    loss = torch.tensor(2.5)
    assert token_loss_sum(loss, labels, torch.float32, head) is loss


# ------------------------------------------------------------------ inside Hugging Face models


def _tiny_llama():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float64)


def _batch(vocab: int, b: int = 2, s: int = 24, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (b, s), generator=g)
    labels = torch.cat([ids[:, 1:], torch.full((b, 1), -100)], 1)
    labels[:, :6] = -100  # a prompt
    return ids, labels


def _standard(model, ids, labels):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, use_cache=False).logits
    loss = token_loss_sum(logits, labels, torch.float64, None)
    loss.backward()
    return loss.detach(), _grads(model)


def _chunked(model, head, ids, labels):
    model.zero_grad(set_to_none=True)
    with head.targets(labels):
        out = model(input_ids=ids, use_cache=False).logits
    loss = token_loss_sum(out, labels, torch.float64, head)
    assert loss.shape == ()
    loss.backward()
    return loss.detach(), _grads(model)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b, bound: float = 1e-12) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert abs(float(loss_a - loss_b)) / float(loss_b) < bound
    assert grads_a.keys() == grads_b.keys() and grads_a
    for name in grads_b:
        assert _rel(grads_a[name], grads_b[name]) < bound, name


def test_tiny_llama_loss_and_every_gradient_equal_the_standard_path() -> None:
    model = _tiny_llama().train()
    ids, labels = _batch(model.config.vocab_size)
    keys = list(model.state_dict())
    old = model.lm_head
    standard = _standard(model, ids, labels)

    head = install_loss_head(model, chunk=16)  # 36 targets: 3 chunks, the last partial
    assert isinstance(head, ChunkedLossHead) and model.lm_head is head
    assert head.weight is old.weight and head.bias is None
    assert list(model.state_dict()) == keys
    assert install_loss_head(model) is head  # installing twice changes nothing
    _assert_same(_chunked(model, head, ids, labels), standard)
    assert len(standard[1]) == len(list(model.parameters()))

    # Outside the context: ordinary logits, as before.
    with torch.no_grad():
        logits = model(input_ids=ids, use_cache=False).logits
        assert torch.equal(
            logits, F.linear(model.model(input_ids=ids).last_hidden_state, old.weight)
        )
    assert logits.shape == (*ids.shape, model.config.vocab_size)


def test_the_context_ends_even_when_the_forward_fails() -> None:
    head = ChunkedLossHead(nn.Linear(4, 6))
    with pytest.raises(ValueError, match="do not match"), head.targets(torch.zeros(3, 2).long()):
        head(torch.randn(2, 3, 4))
    assert head(torch.randn(2, 4)).shape == (2, 6)


def test_peft_lora_model_gets_the_same_loss_and_lora_gradients() -> None:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(_tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for name, p in model.named_parameters():  # LoRA B starts at zero: give it values
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    ids, labels = _batch(model.config.vocab_size, seed=6)
    keys = list(model.state_dict())
    standard = _standard(model, ids, labels)
    head = install_loss_head(model)
    assert isinstance(head, ChunkedLossHead)
    assert model.get_base_model().lm_head is head and list(model.state_dict()) == keys
    chunked = _chunked(model, head, ids, labels)
    _assert_same(chunked, standard)
    assert all("lora_" in n for n in chunked[1]) and head.weight.grad is None


def test_peft_lora_on_lm_head_itself_keeps_the_full_path() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_tiny_llama(), LoraConfig(r=4, target_modules=["q_proj", "lm_head"]))
    assert install_loss_head(model) is None
    assert "not a plain nn.Linear" in (unsupported_reason(model) or "")


def test_tied_gpt2_keeps_one_shared_weight_and_equal_gradients() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=301, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    model = GPT2LMHeadModel(config).to(torch.float64)
    assert model.lm_head.weight is model.transformer.wte.weight
    ids, labels = _batch(301, seed=7)
    keys = list(model.state_dict())
    standard = _standard(model, ids, labels)
    head = install_loss_head(model, chunk=8)
    assert head is not None and head.weight is model.transformer.wte.weight
    assert list(model.state_dict()) == keys
    _assert_same(_chunked(model, head, ids, labels), standard)


def _tiny(config_cls, model_cls, **extra):
    config = config_cls(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, **extra)  # fmt: skip
    return model_cls(config)


def test_models_that_change_logits_after_lm_head_keep_the_full_path() -> None:
    from transformers import (
        CohereConfig,
        CohereForCausalLM,
        Gemma2Config,
        Gemma2ForCausalLM,
        GraniteConfig,
        GraniteForCausalLM,
    )

    cases = [
        (_tiny(Gemma2Config, Gemma2ForCausalLM, final_logit_softcapping=30.0), "softcapping"),
        (_tiny(CohereConfig, CohereForCausalLM, logit_scale=0.0625), "logit_scale"),
        (_tiny(GraniteConfig, GraniteForCausalLM, logits_scaling=8.0), "logits_scaling"),
        # no config value to see: the forward's code is what gives it away
        (_tiny(Gemma2Config, Gemma2ForCausalLM, final_logit_softcapping=None), "changes"),
    ]
    for model, words in cases:
        old = model.lm_head
        assert install_loss_head(model) is None
        assert words in (unsupported_reason(model) or ""), type(model).__name__
        assert model.lm_head is old
