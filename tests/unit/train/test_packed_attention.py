"""homelab_packed (`homelab_dp.train.packed_attention`): exact, lean, every family by registry.

Packed blocks through ``attn_implementation="homelab_packed"`` give each sample the logits and
the gradients it gets alone; the attention runs per sample without a mask or repeated
key/value heads, so what the forward saves for backward is what an unpacked loop of the same
tokens saves (the old SDPA route saved more: its b·s² mask and the repeated heads).
"""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from homelab_dp.planning.attention_rule import PACKED_ATTENTION, choose_attention, packed_route
from homelab_dp.train.attention import attention_implementation
from homelab_dp.train.packed_attention import (
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
    for device, dtype, caps in (("cuda", "fp32", [(9, 0)]), ("cuda", "fp16", [(7, 5)]),
                                ("cuda", "bf16", [None]), ("cpu", "bf16", [])):  # fmt: skip
        assert packed_route(device, dtype, caps) == "SDPA on each sample alone"
