"""Bytes of the loss head: chunked cross-entropy or full logits (pure arithmetic, no torch).

The worker replaces lm_head by `homelab_dp.train.loss.ChunkedLossHead` for every model whose
logits are not changed after lm_head (`unsupported_reason`); Gemma-2's final logit softcapping
keeps the full logits path. The chunk size and the bytes of `train.loss`'s chunked
cross-entropy are defined here, in pure arithmetic, and the worker uses the same chunk size;
tests/unit/test_chunked_loss.py checks `chunk_peak_bytes` against measured live tensor bytes.
"""

from __future__ import annotations

CHUNK_ELEMENTS = 1 << 24
"""Logit elements per chunk: 2^24 (64 MiB in fp32), ~128 tokens at a 128k vocabulary, 8192 at
the demo's 2048 (a whole micro-batch)."""

FULL_LOGITS_TYPES = ("gemma2",)
"""Model types whose logits are transformed after lm_head (final_logit_softcapping)."""


def chunked_loss(model_type: str) -> bool:
    """Whether the worker computes the loss of ``model_type`` chunk by chunk."""
    return model_type not in FULL_LOGITS_TYPES


def chunk_tokens(vocab: int) -> int:
    """Rows per chunk: ``CHUNK_ELEMENTS // vocab``, rounded down to a multiple of 8, at least 8."""
    return max(8, (CHUNK_ELEMENTS // max(1, vocab)) // 8 * 8)


def chunk_peak_bytes(
    vocab: int, hidden: int, tokens: int, compute_bytes: int, *, weight_bytes: int | None = None,
    hidden_bytes: int | None = None, weight_grad: bool = True, targets: int | None = None,
) -> dict[str, int]:  # fmt: skip
    """Bytes the chunked loss holds beyond its inputs: ``saved`` from its forward to its backward,
    and the extra at the forward's and the backward's peaks (on top of ``saved``).

    The terms are listed in `homelab_dp.train.loss`'s docstring. ``tokens``: the micro-batch's
    tokens; ``compute_bytes``: the matmul element size (2 under bf16/fp16, 4 in fp32, 8 in fp64);
    ``weight_bytes`` / ``hidden_bytes`` those of lm_head's weight and of the hidden states,
    ``weight_grad`` False when the weight is frozen. ``targets`` (default: ``tokens``) are the
    tokens with a loss: only their rows get logits; the hidden-state gradient has every row.
    """
    e, v, h, n = compute_bytes, vocab, hidden, (tokens if targets is None else targets)
    a = 8 if e == 8 else 4
    w_b, h_b = weight_bytes or e, hidden_bytes or e
    c = min(chunk_tokens(v), n)
    logits = c * v * a + (c * v * e if e != a else 0) + 4 * c * a + 64
    saved = n * (h * e + 16 + a) + (v * h * e if w_b != e else 0)
    grads = n * h * (e + (h_b if h_b != e else 0)) + tokens * h * h_b
    backward = logits + grads
    if weight_grad:
        product = c * v * e + v * h * e if e != a else 0
        cast = v * h * w_b if w_b != a else 0
        backward = max(logits, product, cast) + v * h * a + grads
    return {"saved": saved, "forward": logits, "backward": backward}


def full_logits_bytes(tokens: int, vocab: int, compute_bytes: int) -> dict[str, int]:
    """The full logits path: ``forward`` at the loss (the logits, in 16-bit beside their fp32
    copy, and the log-softmax output) and ``backward`` at its start (the log-softmax output and
    two fp32 gradients of vocabulary size; the worker drops the logits after the loss)."""
    fwd = tokens * vocab * (8 if compute_bytes == 4 else 10)
    return {"forward": fwd, "backward": tokens * vocab * 12}
