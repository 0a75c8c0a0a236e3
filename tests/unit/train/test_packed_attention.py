"""homelab_packed (`homelab_dp.train.model.packed_attention`): exact, lean, every family by registry.

Packed blocks through ``attn_implementation="homelab_packed"`` give each sample the logits and
the gradients it gets alone; the attention runs per sample without a mask or repeated
key/value heads, so what the forward saves for backward is what an unpacked loop of the same
tokens saves (the old SDPA route saved more: its b·s² mask and the repeated heads).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from homelab_dp.planning.attention_rule import PACKED_ATTENTION, choose_attention, packed_route
from homelab_dp.train.model.attention import attention_implementation
from homelab_dp.train.model.packed_attention import (
    PackedSegments,
    packed_mask,
    register,
    segments_from_starts,
)

VOCAB = 300
ROWS = ((7, 12, 5, 8), (20, 6, 6))  # two packed rows of 32 tokens each, 3-4 samples a row
SEQ = 32


def tiny(arch: str, attn: str) -> torch.nn.Module:
    """A seeded tiny LLaMA (GQA: 4 query, 2 key/value heads) or GPT-2, dropout off."""
    register()
    torch.manual_seed(0)
    if arch == "llama":
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                             bos_token_id=0, eos_token_id=1, pad_token_id=2)  # fmt: skip
        model = LlamaForCausalLM._from_config(config, attn_implementation=attn)
    else:
        config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, attn_pdrop=0.0,
                            resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=1)  # fmt: skip
        model = GPT2LMHeadModel._from_config(config, attn_implementation=attn)
    return model.double().eval()


def packed_batch() -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """(ids, positions) of the packed rows, and each row's samples."""
    g = torch.Generator().manual_seed(5)
    samples = [[torch.randint(3, VOCAB, (n,), generator=g) for n in row] for row in ROWS]
    ids = torch.stack([torch.cat(row) for row in samples])
    pos = torch.stack([torch.cat([torch.arange(len(s)) for s in row]) for row in samples])
    return ids, pos, samples


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_packed_logits_and_gradients_equal_each_sample_alone(arch: str) -> None:
    model = tiny(arch, PACKED_ATTENTION)
    assert model.config._attn_implementation == PACKED_ATTENTION
    ids, pos, samples = packed_batch()
    weights = torch.randn(2, SEQ, VOCAB, generator=torch.Generator().manual_seed(1)).double()
    model.zero_grad()
    packed = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    (packed * weights).sum().backward()
    packed_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    alone = []
    for r, row in enumerate(samples):
        at = 0
        for s in row:
            out = model(input_ids=s[None], use_cache=False).logits[0]
            (out * weights[r, at : at + len(s)]).sum().backward()
            alone.append(out.detach())
            at += len(s)
    alone_logits = torch.stack([torch.cat(alone[:4]), torch.cat(alone[4:])])
    assert float((packed.detach() - alone_logits).abs().max()) < 1e-10
    worst = max(float((packed_grads[n] - p.grad).abs().max()) for n, p in model.named_parameters())
    assert worst < 1e-10
    # The comparison can fail: one run of positions (no restarts) lets samples see each other.
    run = model(input_ids=ids, position_ids=torch.arange(SEQ).expand(2, SEQ), use_cache=False)
    assert float((run.logits[:, 7:].detach() - alone_logits[:, 7:]).abs().max()) > 1e-3


def test_the_mask_step_reads_sample_starts_and_padding() -> None:
    from transformers.masking_utils import create_causal_mask

    model = tiny("llama", PACKED_ATTENTION)
    ids, pos, _ = packed_batch()
    embeds = model.model.embed_tokens(ids)
    seg = create_causal_mask(model.config, embeds, None, None, position_ids=pos)
    assert isinstance(seg, PackedSegments) and seg.lengths == ROWS and seg.max_len == 20
    assert seg.cu_seqlens().tolist() == [0, 7, 19, 24, 32, 52, 58, 64]
    # Right padding (pack = false): the real tokens, then the padding, each a segment.
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 10:] = 0
    seg = create_causal_mask(model.config, embeds, mask, None, position_ids=None)
    assert isinstance(seg, PackedSegments) and seg.lengths == ((32,), (10, 22))
    # Left padding is no prefix: SDPA's own 4D mask, unchanged.
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, :3] = 0
    four_d = create_causal_mask(model.config, embeds, mask, None, position_ids=None)
    assert isinstance(four_d, torch.Tensor) and four_d.shape == (2, 1, SEQ, SEQ)
    # Not causal (a bidirectional rule) or with an offset (a cache): SDPA's mask.
    both = packed_mask(2, SEQ, SEQ, mask_function=lambda b, h, q, k: q >= 0, device="cpu")
    assert both is None or isinstance(both, torch.Tensor)
    assert segments_from_starts([[True, False, True, True]]) == ((2, 1, 1),)


def test_padded_rows_give_sdpa_logits_on_their_real_tokens() -> None:
    lean, sdpa = tiny("llama", PACKED_ATTENTION), tiny("llama", "sdpa")
    ids, _, _ = packed_batch()
    mask = torch.ones(2, SEQ, dtype=torch.long)
    mask[1, 13:] = 0
    a = lean(input_ids=ids, attention_mask=mask, use_cache=False).logits
    b = sdpa(input_ids=ids, attention_mask=mask, use_cache=False).logits
    a, b = a.detach(), b.detach()
    assert float((a[0] - b[0]).abs().max()) < 1e-10
    assert float((a[1, :13] - b[1, :13]).abs().max()) < 1e-10


def test_attention_per_sample_without_mask_or_repeated_heads(monkeypatch) -> None:
    calls: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []
    kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def spy(q, k, v, dropout, causal, **kw):  # noqa: ANN001, ANN003
        calls.append((tuple(q.shape), tuple(k.shape), causal and kw.get("attn_mask") is None))
        return kernel(q, k, v, dropout, causal, **kw)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", spy)
    model = tiny("llama", PACKED_ATTENTION)
    ids, pos, _ = packed_batch()
    model(input_ids=ids, position_ids=pos, use_cache=False)
    per_layer = [n for row in ROWS for n in row]
    assert [c[0][2] for c in calls] == per_layer * 2  # one call per sample per layer
    assert all(c[0][1] == 4 and c[1][1] == 2 for c in calls)  # 2 key/value heads, not 4
    assert all(c[2] for c in calls)  # no mask: causal within the sample alone


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor, pos: torch.Tensor | None) -> int:
    """Bytes of the distinct storages one forward saves for backward."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type == "cpu" and not isinstance(t, torch.nn.Parameter):
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    model.train()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, position_ids=pos, use_cache=False).logits.sum()
    return sum(n for ptr, n in seen.items() if ptr not in params)


def test_a_packed_block_saves_what_its_samples_save_alone() -> None:
    ids, pos, samples = packed_batch()
    alone_model = tiny("llama", PACKED_ATTENTION)
    alone = sum(saved_bytes(alone_model, s[None], None) for row in samples for s in row)
    lean = saved_bytes(tiny("llama", PACKED_ATTENTION), ids, pos)
    masked = saved_bytes(tiny("llama", "sdpa"), ids, pos)  # the route before homelab_packed
    assert lean <= 1.05 * alone, (lean, alone)
    assert masked > 1.05 * alone, (masked, alone)  # its mask and repeated heads (measured +8.5%)


def test_the_rule_names_the_route() -> None:
    name, why = choose_attention("cpu", "fp32")
    assert name == PACKED_ATTENTION and "SDPA on each sample alone" in why and "CUDA" in why
    assert attention_implementation("cpu", "bf16") == PACKED_ATTENTION
    assert (
        packed_route("cuda", "bf16", [(8, 0), (9, 0)]) == "torch's varlen_attn, each sample alone"
    )
    assert packed_route("cpu", "bf16", []) == "SDPA on each sample alone"
    # Without grouped-query attention nothing is repeated (the memory-efficient kernel takes it).
    assert packed_route("cuda", "fp32", [(9, 0)], gqa=False) == "SDPA on each sample alone"
    for device, dtype, caps in (("cuda", "fp32", [(9, 0)]), ("cuda", "fp16", [(7, 5)]),
                                ("cuda", "bf16", [None])):  # fmt: skip
        assert packed_route(device, dtype, caps) == (
            "SDPA on each sample alone, grouped-query key/value heads repeated"
        )


# ------------------------------------------------------------------ which route runs (issue 32)


@pytest.mark.parametrize(
    ("device", "dtype", "cap", "head_dim", "gqa", "extra", "route"),
    [
        ("cuda", "bf16", (9, 0), 128, True, {}, "varlen"),
        ("cuda", "fp16", (8, 6), 64, False, {}, "varlen"),
        ("cuda", "bf16", None, 128, True, {}, "varlen"),  # a what-if card counts as new enough
        # Below 8.0 or in fp32 the flash kernel cannot run; with GQA SDPA would fall to math.
        ("cuda", "fp16", (7, 5), 128, True, {}, "sdpa-repeat-kv"),
        ("cuda", "fp16", (7, 0), 64, True, {}, "sdpa-repeat-kv"),
        ("cuda", "fp32", (9, 0), 128, True, {}, "sdpa-repeat-kv"),
        ("cuda", "fp16", (7, 5), 128, False, {}, "sdpa"),  # no GQA: memory-efficient kernel
        ("cuda", "fp32", (9, 0), 128, False, {}, "sdpa"),
        # A head dimension FlashAttention refuses: not varlen, and GQA repeated.
        ("cuda", "bf16", (9, 0), 80 + 4, True, {}, "sdpa-repeat-kv"),
        ("cuda", "bf16", (9, 0), 320, False, {}, "sdpa"),
        # Dropout: varlen takes none, SDPA's flash kernel does (and takes GQA).
        ("cuda", "bf16", (9, 0), 128, True, {"dropout": True}, "sdpa"),
        # A window on a torch whose varlen_attn has no window_size: a band mask, no flash kernel.
        ("cuda", "bf16", (9, 0), 128, True, {"window": True, "varlen_window": False},
         "sdpa-repeat-kv"),
        ("cuda", "bf16", (9, 0), 128, True, {"varlen": False}, "sdpa"),
        ("cpu", "fp32", None, 128, True, {}, "sdpa"),  # the CPU's flash kernel takes GQA
        ("cpu", "bf16", None, 36, True, {}, "sdpa"),
    ],
)  # fmt: skip
def test_the_kernel_rule_routes_gqa_where_a_fused_kernel_runs(
    device, dtype, cap, head_dim, gqa, extra, route
) -> None:
    from homelab_dp.planning.attention_rule import packed_kernel

    assert packed_kernel(device, dtype, cap, head_dim, gqa, **extra) == route


def qkv(dtype: torch.dtype = torch.float64, heads: int = 4, kv: int = 2, d: int = 16):
    g = torch.Generator().manual_seed(7)
    b, s = len(ROWS), SEQ
    q = torch.randn(b, heads, s, d, generator=g, dtype=dtype)
    k, v = (torch.randn(b, kv, s, d, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v, PackedSegments(ROWS, torch.device("cpu"))


def test_the_repeat_kv_route_gives_sdpa_full_heads_and_the_same_result(monkeypatch) -> None:
    """``sdpa-repeat-kv`` (run here on the CPU through SDPA's per-sample loop, as on a card
    below 8.0): each sample's key/value heads repeated, no ``enable_gqa``, exactly the GQA
    result."""
    from homelab_dp.train.model import packed_attention as pa

    q, k, v, seg = qkv()
    shared = pa._per_sample(q, k, v, seg, scale=None, dropout=0.0, window=5, causal=True)
    calls: list[tuple[int, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, **kw):  # noqa: ANN001, ANN003
        calls.append((k.shape[1], kw.get("enable_gqa", False)))
        return sdpa(q, k, v, **kw)

    monkeypatch.setattr(pa.F, "scaled_dot_product_attention", spy)
    repeated = pa._per_sample(q, k, v, seg, scale=None, dropout=0.0, window=5, causal=True,
                              repeat_kv=True)  # fmt: skip
    assert calls and all(c == (4, False) for c in calls)  # query-wide k/v, no GQA flag
    assert torch.allclose(repeated, shared, atol=1e-12)


def test_the_forward_casts_to_autocast_dtype_and_counts_its_route() -> None:
    """Under autocast RoPE hands fp32 q/k/v: the attention computes in autocast's dtype (the
    dtype the route is chosen by), and the route that ran is counted."""
    from homelab_dp.train.model.packed_attention import packed_attention_forward, take_route_counts

    q, k, v, seg = qkv(torch.float32)
    module = torch.nn.Module()
    take_route_counts()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, _ = packed_attention_forward(module, q, k, v, seg)
    assert out.dtype == torch.bfloat16
    assert take_route_counts() == {"sdpa": 1}
    model = tiny("llama", PACKED_ATTENTION)
    ids, pos, _ = packed_batch()
    model(input_ids=ids, position_ids=pos, use_cache=False)
    assert take_route_counts() == {"sdpa": 2}  # one call per layer, counted, then reset
    assert take_route_counts() == {}


def test_the_varlen_signature_is_read_once_per_process(monkeypatch) -> None:
    from homelab_dp.train.model import packed_attention as pa

    seen = []
    signature = pa.inspect.signature
    monkeypatch.setattr(pa.inspect, "signature", lambda f: seen.append(f) or signature(f))
    pa._varlen_call.cache_clear()
    q, k, _, _ = qkv()
    for _ in range(5):
        pa.packed_route(q, k)
    assert len(seen) <= 1
    pa._varlen_call.cache_clear()


def _stand_in_varlen(
    q, k, v, cu_q, cu_k, max_q, max_k, scale=None, window_size=(-1, -1), enable_gqa=False
):  # noqa: ANN001
    """torch's varlen_attn on the CPU (the card's kernel is out of reach here): each segment
    alone, causal, by SDPA."""
    out = torch.empty_like(q)
    for a, b in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), strict=True):
        piece = F.scaled_dot_product_attention(
            *(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, scale=scale,
            enable_gqa=enable_gqa,
        )  # fmt: skip
        out[a:b] = piece[0].transpose(0, 1)
    return out


def _stand_in_varlen_no_scale(
    q, k, v, cu_q, cu_k, max_q, max_k, *, is_causal=False, enable_gqa=False
):  # noqa: ANN001
    """The same, with torch 2.9's keywords: no ``scale`` (1/sqrt(head_dim) always)."""
    return _stand_in_varlen(q, k, v, cu_q, cu_k, max_q, max_k, enable_gqa=enable_gqa)


@pytest.mark.parametrize("fn", [_stand_in_varlen, _stand_in_varlen_no_scale])
def test_varlen_takes_the_scale_on_every_allowed_torch(monkeypatch, fn) -> None:
    """``varlen_attn`` with and without a ``scale`` keyword (torch 2.10+ and 2.9): a model's own
    scale (Gemma's query_pre_attn_scalar, ...) is applied either way."""
    import inspect

    from homelab_dp.train.model import packed_attention as pa

    names = frozenset(inspect.signature(fn).parameters)
    monkeypatch.setattr(pa, "_varlen_call", lambda: (fn, names))
    q, k, v, seg = qkv()
    for scale in (None, 0.05):
        got = pa._varlen(q, k, v, seg, scale=scale, window=None)
        want = pa._per_sample(q, k, v, seg, scale=scale, dropout=0.0, window=None, causal=True)
        assert torch.allclose(got, want, atol=1e-10), scale
    assert pa.varlen_kwargs(names, 0.05, 64) == (
        ({"scale": 0.05}, 1.0) if "scale" in names else ({}, 0.05 * 8.0)
    )


# ------------------------------------------------------------------ attention sinks (gpt-oss)


def tiny_gpt_oss(attn: str) -> torch.nn.Module:
    """A seeded tiny gpt-oss (sinks of size, a sliding layer of window 8 and a full one)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    register()
    torch.manual_seed(0)
    config = GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                          sliding_window=8, layer_types=["sliding_attention", "full_attention"])  # fmt: skip
    model = GptOssForCausalLM._from_config(
        config, attn_implementation=attn, experts_implementation="eager"
    ).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0.0, 1.0)  # sinks that matter (they start at zero)
    return model.eval()


def test_gpt_oss_packed_keeps_its_sinks_and_equals_each_sample_alone() -> None:
    """homelab_packed adds gpt-oss's sink logit in each sample's softmax and finds the samples
    from the forward's position_ids (gpt-oss keeps them from the mask builder): logits and
    gradients equal its own eager attention on each sample alone."""
    from homelab_dp.train.model.packed_attention import take_route_counts, watch_positions

    eager = tiny_gpt_oss("eager")
    packed = watch_positions(tiny_gpt_oss(PACKED_ATTENTION))
    packed.load_state_dict(eager.state_dict())
    ids, pos, samples = packed_batch()
    weights = torch.randn(2, SEQ, VOCAB, generator=torch.Generator().manual_seed(1)).double()
    take_route_counts()
    out = packed(input_ids=ids, position_ids=pos, use_cache=False).logits
    assert take_route_counts() == {"sinks": 2}
    (out * weights).sum().backward()
    for r, row in enumerate(samples):
        at = 0
        for s in row:
            ref = eager(input_ids=s[None], use_cache=False).logits[0]
            (ref * weights[r, at : at + len(s)]).sum().backward()
            assert torch.allclose(out[r, at : at + len(s)], ref, atol=1e-10)
            at += len(s)
    for (name, p), q in zip(packed.named_parameters(), eager.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-9), name
    sinks = dict(packed.named_parameters())["model.layers.0.self_attn.sinks"]
    assert sinks.grad.abs().max() > 0  # the sinks are in the softmax: they get a gradient
    # Generation (a KV cache: no segments) keeps them too, through gpt-oss's own eager.
    prompt = ids[:1, :10]
    assert packed.generate(prompt, max_new_tokens=4, do_sample=False).tolist() == (
        eager.generate(prompt, max_new_tokens=4, do_sample=False).tolist()
    )


def test_one_rule_keeps_sinks_on_every_load() -> None:
    """FlashAttention-2 (even installed, on Ampere) and SDPA drop sinks: a model with sinks is
    trained and evaluated through homelab_packed, chatted with and served through its eager."""
    from homelab_dp.planning.attention_rule import has_sinks, inference_attention

    name, why = choose_attention("cuda", "bf16", [(9, 0)], "2.7.4.post1", sinks=True)
    assert name == PACKED_ATTENTION and "sinks" in why
    assert choose_attention("cuda", "bf16", [(9, 0)], "2.7.4.post1")[0] == "flash_attention_2"
    assert attention_implementation("cpu", "fp32", model_type="gpt_oss") == PACKED_ATTENTION
    assert has_sinks("gpt_oss") and not has_sinks("llama")
    assert inference_attention("gpt_oss") == "eager" and inference_attention("llama") is None


class _Reads(torch.overrides.TorchFunctionMode):
    """Counts the host reads (``tolist``, ``item``, ``__bool__``) of a forward."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        if getattr(func, "__name__", "") in ("tolist", "item", "__bool__"):
            self.n += 1
        return func(*args, **(kwargs or {}))


def test_known_segments_spare_the_forward_its_reads_once_checked(monkeypatch) -> None:
    """Segments found on the host (`block_segments`) stand in for the mask step's read once one
    forward checked them against the mask function's own; a hint that disagrees is never used."""
    from homelab_dp.train.model import packed_attention as pa

    monkeypatch.setattr(pa, "_trusted", {})
    model = pa.watch_positions(tiny("llama", PACKED_ATTENTION))
    ids, pos, _ = packed_batch()
    padded = pos.clone()
    padded[1, 26:] = torch.arange(6)  # the last sample cut by a padding run: a segment too
    assert pa.block_segments(pos) == list(ROWS)
    assert pa.block_segments(padded, rows=1) == [ROWS[0], (20, 6, 6)]
    assert pa.block_segments(torch.arange(5).expand(3, 5)) == [(5,)] * 3
    want = model(input_ids=ids, position_ids=pos, use_cache=False).logits.detach()

    def forward(lengths: tuple[tuple[int, ...], ...]) -> tuple[torch.Tensor, int]:
        reads = _Reads()
        with pa.known_segments(pos, PackedSegments(lengths, pos.device)), reads:
            out = model(input_ids=ids, position_ids=pos, use_cache=False).logits.detach()
        return out, reads.n

    first, checked = forward(ROWS)  # read once, found equal
    again, unread = forward(ROWS)
    assert checked >= 1 and unread == 0
    assert torch.equal(first, want) and torch.equal(again, want)
    monkeypatch.setattr(pa, "_trusted", {})
    wrong = ((32,), (16, 16))
    for _ in range(2):  # found unequal: every forward reads its own, the hint is not used
        out, reads = forward(wrong)
        assert reads >= 1 and torch.equal(out, want)
    # Other positions than the hint's tensor (an equal copy too) are read as before.
    reads = _Reads()
    with pa.known_segments(pos.clone(), PackedSegments(ROWS, pos.device)), reads:
        model(input_ids=ids, position_ids=pos, use_cache=False)
    assert reads.n >= 1
