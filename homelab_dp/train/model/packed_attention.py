"""Packed attention without a mask: each sample of a block attends to itself alone.

Registered in transformers' attention-function registry (`AttentionInterface`) and its
mask registry (`AttentionMaskInterface`) under ``PACKED_ATTENTION`` ("homelab_packed"), so
every family whose forward goes through the registries (llama, qwen, mistral, gemma, gpt2, …)
gets it by ``attn_implementation="homelab_packed"`` (`train.model.attention`).

**The mask step** (`packed_mask`, once per forward, shared by the layers): where SDPA's mask
builder materializes a ``(batch, 1, seq, seq)`` block-diagonal mask for a packed block, this
one only reads where the samples start: transformers' own mask function (the causal rule, the
packing restarts it found in ``position_ids``, a chunked-attention rule) evaluated on the
``seq - 1`` pairs (token j, token j - 1): a pair it refuses starts a new sample. The result,
`PackedSegments`, is the lengths of the samples of every row (one host sync a forward, as
FlashAttention's route in transformers does). A padded row (a 2D mask, padding at the end)
gets its real tokens as one segment and the padding as another. Anything else (a mask that is
not causal, a custom overlay, a KV cache, left padding) goes to SDPA's mask unchanged.

**Segments known on the host** (`known_segments`, the worker's packed SFT micro-steps): the
samples of a block are found once for the data set where the blocks are built
(`block_segments`: a sample starts where the positions do not continue, transformers' packing
rule). For the forward whose ``position_ids`` is that very tensor, the mask step checks them
against its own read once per mask kind (`_mask_kind`: the mask function's code and settings)
and, found equal, takes them from then on without reading anything; found unequal (a rule
beyond causal attention and the positions' restarts), it reads every forward as before. The
same forward's packing check in transformers (``find_packed_sequence_indices``, a ``bool`` of a
device tensor) is skipped too: the host knows whether any row holds several samples. So a
packed micro-step makes no host sync before its backward.

**The attention step** (`packed_attention_forward`, per layer): with `PackedSegments`, one
attention per sample, so no mask and no repeated key/value heads are allocated and no work is
spent on the zeros of a block-diagonal mask:

The route is `homelab_dp.planning.attention_rule.packed_kernel`'s, one rule for the worker
and the plan's memory count, decided on q/k/v in the dtype the attention computes in (under
autocast with fp32 master weights RoPE hands fp32 q/k: they are cast to autocast's dtype
first), and every call is counted by route (`take_route_counts`: the first step event's
``attention_routes``, what ran):

- ``varlen`` (CUDA, bf16/fp16, compute capability 8.0+, a head dimension of at most 256 and a
  multiple of 8, no dropout): torch's own ``torch.nn.attention.varlen.varlen_attn``
  (FlashAttention's varlen kernel shipped in torch, no ``flash-attn`` build) over the flattened
  tokens with cumulative sequence lengths, native GQA and sliding windows where this torch's
  signature takes them (read once a process), and the scale by keyword or, on a torch whose
  ``varlen_attn`` has no ``scale`` (2.9), on the query.
- ``sdpa`` (the CPU, a model without GQA, or where SDPA's flash kernel runs):
  ``scaled_dot_product_attention`` on each sample's slice with ``is_causal`` and
  ``enable_gqa`` (no mask, key/value heads shared). On the CPU this is SDPA's flash kernel,
  which takes GQA natively; FlexAttention has no backward on the CPU (torch 2.13:
  "FlexAttention does not support backward on CPU"). Measured on this repository's CPU: 37 ms
  against the masked route's 71 ms for a forward and backward of 4 × 512 tokens, 8 query and
  4 key/value heads (benchmarks/packing.py --attention).
- ``sdpa-repeat-kv`` (CUDA with GQA where the flash kernel cannot run: below 8.0, fp32, a head
  dimension it refuses, a window's band mask): the same per sample with that sample's
  key/value heads repeated, so that the memory-efficient kernel runs; with ``enable_gqa`` torch
  would run the math kernel, a heads × n² fp32 matrix per sample saved for backward.

It saves what SDPA on one sample alone saves (q, k, v, the output pieces, their logsumexp) and
the output rows joined as the model expects them, ``(batch, seq, heads, head_dim)``: the same
tensors an unpacked loop keeps for the same tokens (SDPA's output there is made contiguous for
the output projection too). Any other mask (a 4D tensor, None without packing) goes to
transformers' SDPA function unchanged.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from homelab_dp.planning.attention_rule import packed_kernel

PACKED_ATTENTION = "homelab_packed"
"""The ``attn_implementation`` name of this module's attention (`register`)."""
DTYPE_NAMES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
               torch.float64: "fp64"}  # fmt: skip
"""The rule's dtype words (`homelab_dp.planning.attention_rule.packed_kernel`)."""

_lock = threading.Lock()
_registered = False
_positions: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar(
    "homelab_packed_positions", default=None
)
"""The ``position_ids`` of the forward in progress, for a family whose forward does not hand
them to transformers' mask builder (gpt-oss): set by `watch_positions`' hook."""
_routes: Counter[str] = Counter()
"""Calls per route since the last `take_route_counts` (this process)."""
_known: contextvars.ContextVar[tuple[torch.Tensor, PackedSegments] | None] = contextvars.ContextVar(
    "homelab_packed_known", default=None
)
"""The forward's ``position_ids`` and the segments the host already knows for them
(`known_segments`)."""
_trusted: dict[Any, bool] = {}
"""Per mask kind (`_mask_kind`): whether its segments were found equal to the host's."""


def take_route_counts() -> dict[str, int]:
    """The routes ``homelab_packed`` took since the last call (attention calls, all layers), and
    start counting afresh: what ran, counted, for the step event."""
    with _lock:
        out = dict(_routes)
        _routes.clear()
    return out


@dataclass(frozen=True)
class PackedSegments:
    """What the attention of a packed (or right-padded) micro-batch needs: sample lengths."""

    lengths: tuple[tuple[int, ...], ...]
    """Per row, the length of each segment in order; they sum to the row's length. A segment is
    one sample (or a row's padding), attended causally to itself alone."""
    device: torch.device
    """Where the batch lives (the cumulative lengths for ``varlen_attn`` are made there)."""
    _cu: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def max_len(self) -> int:
        """The longest segment."""
        return max(max(row) for row in self.lengths)

    def cu_seqlens(self) -> torch.Tensor:
        """Cumulative segment lengths over the flattened rows (int32, on ``device``), made once."""
        if "cu" not in self._cu:
            flat = [n for row in self.lengths for n in row]
            cu = torch.zeros(len(flat) + 1, dtype=torch.int32)
            cu[1:] = torch.tensor(flat, dtype=torch.int32).cumsum(0)
            self._cu["cu"] = cu.to(self.device, non_blocking=True)
        return self._cu["cu"]


def block_segments(positions: torch.Tensor, rows: int = 1024) -> list[tuple[int, ...]]:
    """Segment lengths of every block of ``positions`` (``[n_blocks, seq]``, on the host): a
    segment starts where the positions do not continue (transformers' packing rule, so a block's
    padding run is a segment too). Made once for a data set; ``rows`` blocks at a time."""
    out: list[tuple[int, ...]] = []
    seq = int(positions.shape[-1])
    for at in range(0, int(positions.shape[0]), rows):
        part = positions[at : at + rows]
        starts = torch.ones(part.shape[0], seq + 1, dtype=torch.bool)
        starts[:, 1:seq] = (part[:, 1:] - part[:, :-1]) != 1
        where = starts.nonzero()  # row-major: each row's starts in order, then its end (seq)
        cols = where[:, 1].tolist()
        counts = starts.sum(1).tolist()
        i = 0
        for n in counts:
            edges = cols[i : i + n]
            out.append(tuple(b - a for a, b in zip(edges[:-1], edges[1:], strict=True)))
            i += n
    return out


@contextlib.contextmanager
def known_segments(positions: torch.Tensor, segments: PackedSegments) -> Iterator[None]:
    """While inside, the mask step of a forward whose ``position_ids`` is ``positions`` (this
    very tensor) takes ``segments``, found on the host where the blocks were built, instead of
    reading them from the device (a host sync a forward). The mask step checks them once per mask
    kind (`_mask_kind`: its code and settings) against the mask function's own and, where they
    differ (a rule beyond causal attention and the positions' restarts), reads every forward's
    own as before."""
    token = _known.set((positions, segments))
    try:
        yield
    finally:
        _known.reset(token)


def _mask_kind(fn: Any) -> Any:
    """What a mask function computes apart from its data: its code, and its closure's functions
    (recursively) and plain settings (window, chunk sizes); tensors in it count as data. None
    for anything else (never trusted)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return None
    cells: list[Any] = []
    for cell in fn.__closure__ or ():
        try:
            value = cell.cell_contents
        except ValueError:  # an empty cell
            return None
        items = value if isinstance(value, tuple | list) else (value,)
        for v in items:
            if isinstance(v, torch.Tensor):
                cells.append(("tensor", v.dim()))
            elif v is None or isinstance(v, bool | int | float | str | torch.device | torch.dtype):
                cells.append(v)
            elif callable(v):
                kind = _mask_kind(v)
                if kind is None:
                    return None
                cells.append(kind)
            else:
                return None
    return code, tuple(cells)


def segments_from_starts(starts: list[list[bool]]) -> tuple[tuple[int, ...], ...]:
    """Segment lengths per row from "token j starts a segment" flags (token 0 always does)."""
    out = []
    for row in starts:
        lengths, run = [], 0
        for j, start in enumerate(row):
            if start and j > 0:
                lengths.append(run)
                run = 0
            run += 1
        lengths.append(run)
        out.append(tuple(lengths))
    return tuple(out)


def packed_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """The mask step of ``homelab_packed`` (see the module docstring): `PackedSegments` for a
    causal, packed or right-padded batch without a cache; SDPA's own mask otherwise."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    def sdpa() -> Any:
        return sdpa_mask(
            batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
            kv_offset=kv_offset, mask_function=mask_function or causal_mask_function,
            attention_mask=attention_mask, **kwargs,
        )  # fmt: skip

    if (
        mask_function is None
        or kwargs.get("use_vmap")  # an overlay of the caller's own: its pattern is unknown
        or q_length != kv_length
        or q_offset
        or kv_offset
        or q_length < 2
    ):
        return sdpa()
    device = kwargs.get("device") or (
        attention_mask.device if attention_mask is not None else torch.device("cpu")
    )
    known = _known.get()
    if known is not None and attention_mask is None:
        positions, segments = known
        if positions is _positions.get() and len(segments.lengths) == batch_size:
            kind = _mask_kind(mask_function)
            key = (kind, batch_size, q_length)
            if kind is not None and _trusted.get(key):
                return segments
            found = _read_mask(batch_size, q_length, mask_function, attention_mask, device, sdpa)
            if kind is not None and key not in _trusted:
                same = isinstance(found, PackedSegments) and found.lengths == segments.lengths
                _trusted[key] = same
            return found
    return _read_mask(batch_size, q_length, mask_function, attention_mask, device, sdpa)


def _read_mask(
    batch_size: int, q_length: int, mask_function: Any, attention_mask: torch.Tensor | None,
    device: Any, sdpa: Any,
) -> Any:  # fmt: skip
    """`packed_mask`'s segments read from the mask function on the device (one host sync);
    ``sdpa()`` where the mask is not causal or the padding is not at the end."""
    kv_length = q_length
    b = torch.arange(batch_size, device=device)[:, None]
    h = torch.zeros(1, 1, dtype=torch.long, device=device)
    j = torch.arange(1, q_length, device=device)[None, :]
    back = torch.as_tensor(mask_function(b, h, j, j - 1), device=device)  # j sees j-1?
    ahead = torch.as_tensor(mask_function(b, h, j - 1, j), device=device)  # j-1 sees j?
    starts = ~back.expand(batch_size, q_length - 1)
    if attention_mask is not None:
        valid = attention_mask[:, -kv_length:].bool()
        n = valid.sum(-1, keepdim=True)
        prefix = (valid == (torch.arange(kv_length, device=device)[None, :] < n)).all()
        starts = starts | (torch.arange(1, kv_length, device=device)[None, :] == n)
    else:
        prefix = torch.ones((), dtype=torch.bool, device=device)
    positions = _positions.get()
    if positions is not None and tuple(positions.shape) == (batch_size, q_length):
        # A family that does not hand position_ids to the mask builder (gpt-oss): the
        # restarts of the forward's positions start samples too (read in the same sync).
        starts = starts | ((positions[:, 1:] - positions[:, :-1]) != 1).to(device)
    flags = torch.cat([ahead.any().reshape(1), (~prefix).reshape(1), starts.reshape(-1)]).tolist()
    if flags[0] or flags[1]:  # not causal (bidirectional, an overlay), or left padding
        return sdpa()
    rows = flags[2:]
    step = q_length - 1
    starts_list = [[True, *rows[r * step : (r + 1) * step]] for r in range(batch_size)]
    return PackedSegments(segments_from_starts(starts_list), device)


@functools.cache
def _varlen_call() -> tuple[Any, frozenset[str]] | None:
    """torch's ``varlen_attn`` and the names its signature takes, or None without it (read once
    a process, not per layer)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def _capability(device: torch.device) -> tuple[int, int] | None:
    """The card's compute capability (None off CUDA)."""
    if device.type != "cuda":
        return None
    return _cached_capability(device.index if device.index is not None else -1)


@functools.cache
def _cached_capability(index: int) -> tuple[int, int]:
    major, minor = torch.cuda.get_device_capability(None if index < 0 else index)
    return int(major), int(minor)


def packed_route(
    query: torch.Tensor, key: torch.Tensor | None = None, *, dropout: float = 0.0,
    window: int | None = None, sinks: bool = False,
) -> str:  # fmt: skip
    """The route for ``query`` (and ``key``: grouped-query attention when it has fewer heads),
    by `homelab_dp.planning.attention_rule.packed_kernel` on this card: ``"varlen"``,
    ``"sdpa"`` or ``"sdpa-repeat-kv"``. ``query`` is in the dtype the attention computes in
    (autocast's, `packed_attention_forward` casts first)."""
    call = _varlen_call()
    return packed_kernel(
        query.device.type, DTYPE_NAMES.get(query.dtype, str(query.dtype)),
        _capability(query.device), int(query.shape[-1]),
        key is not None and key.shape[1] != query.shape[1], dropout=dropout > 0,
        window=window is not None, varlen=call is not None,
        varlen_window=call is not None and "window_size" in call[1], sinks=sinks,
    )  # fmt: skip


class _CpuPerSample(torch.autograd.Function):
    """SDPA's CPU flash kernel on each sample, written into one ``(batch, seq, heads,
    head_dim)`` output: saved are q, k, v, that output (which the output projection saves too,
    as a view) and the logsumexp, as for one sample alone; joining the pieces with ``cat``
    would save an extra copy of the output per layer."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        lengths: tuple[tuple[int, ...], ...], scale: float | None,
    ) -> torch.Tensor:  # fmt: skip
        b, heads, s, d = query.shape
        out = query.new_empty(b, s, heads, d)
        lse: torch.Tensor | None = None
        flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        for r, at, n in _spans(lengths):
            span = slice(at, at + n)
            o, lse_piece = flash(
                query[r : r + 1, :, span], key[r : r + 1, :, span], value[r : r + 1, :, span],
                0.0, True, scale=scale,
            )  # fmt: skip
            if lse is None:
                lse = query.new_empty(b, heads, s, dtype=lse_piece.dtype)
            out[r, at : at + n] = o[0].transpose(0, 1)
            lse[r, :, at : at + n] = lse_piece[0]
        ctx.save_for_backward(query, key, value, out, lse)
        ctx.lengths, ctx.scale = lengths, scale
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        query, key, value, out, lse = ctx.saved_tensors
        gq, gk, gv = (torch.empty_like(t) for t in (query, key, value))
        flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
        for r, at, n in _spans(ctx.lengths):
            span = slice(at, at + n)
            dq, dk, dv = flash_backward(
                grad[r : r + 1, span].transpose(1, 2), query[r : r + 1, :, span],
                key[r : r + 1, :, span], value[r : r + 1, :, span],
                out[r : r + 1, span].transpose(1, 2), lse[r : r + 1, :, span].contiguous(),
                0.0, True, scale=ctx.scale,
            )  # fmt: skip
            gq[r : r + 1, :, span], gk[r : r + 1, :, span], gv[r : r + 1, :, span] = dq, dk, dv
        return gq, gk, gv, None, None


def _spans(lengths: tuple[tuple[int, ...], ...]) -> list[tuple[int, int, int]]:
    """(row, start, length) of every segment."""
    out = []
    for r, row in enumerate(lengths):
        at = 0
        for n in row:
            out.append((r, at, n))
            at += n
    return out


def _per_sample(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: PackedSegments, *,
    scale: float | None, dropout: float, window: int | None, causal: bool,
    repeat_kv: bool = False,
) -> torch.Tensor:  # fmt: skip
    """SDPA on each sample's slice; ``(batch, seq, heads, head_dim)``. On the CPU without
    dropout or a window, `_CpuPerSample` (the same kernel, no extra copy of the output); that
    kernel takes no fp16 on the CPU and one dtype for q, k and v, so anything else goes sample
    by sample through SDPA. ``repeat_kv`` (the ``"sdpa-repeat-kv"`` route): each sample's
    key/value heads repeated to the query heads, so SDPA's memory-efficient kernel runs."""
    rep = 1
    dtypes = {query.dtype, key.dtype, value.dtype}
    cpu_kernel = query.device.type == "cpu" and len(dtypes) == 1 and torch.float16 not in dtypes
    if cpu_kernel and dropout == 0 and window is None and causal:
        return _CpuPerSample.apply(query, key, value, segments.lengths, scale)
    gqa = key.shape[1] != query.shape[1]
    if gqa and repeat_kv:  # the memory-efficient kernel takes no GQA: each sample's heads repeated
        rep = query.shape[1] // key.shape[1]
        gqa = False
    rows = []
    for r, lengths in enumerate(segments.lengths):
        pieces, at = [], 0
        for n in lengths:
            q, k, v = (t[r : r + 1, :, at : at + n] for t in (query, key, value))
            if repeat_kv and rep > 1:
                k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            mask = None
            if window is not None and n > window:  # a band within this sample alone
                i = torch.arange(n, device=query.device)
                d = i[:, None] - i[None, :]
                mask = (d >= 0) & (d < window)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=causal and mask is None,
                scale=scale, enable_gqa=gqa,
            )  # fmt: skip
            pieces.append(out.transpose(1, 2))
            at += n
        rows.append(torch.cat(pieces, dim=1) if len(pieces) > 1 else pieces[0].contiguous())
    return torch.cat(rows, dim=0) if len(rows) > 1 else rows[0]


def _with_sinks(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: PackedSegments,
    sinks: torch.Tensor, *, scale: float | None, dropout: float, window: int | None,
    training: bool,
) -> torch.Tensor:  # fmt: skip
    """Each sample's causal softmax over its own keys and one learned sink logit per head
    (gpt-oss's ``s_aux``, as its eager attention computes it, sample by sample instead of over
    the whole block); ``(batch, seq, heads, head_dim)``. The sink takes probability mass but
    adds no value."""
    heads, d = query.shape[1], query.shape[-1]
    rep = heads // key.shape[1]
    scale = d**-0.5 if scale is None else scale
    rows = []
    for r, lengths in enumerate(segments.lengths):
        pieces, at = [], 0
        for n in lengths:
            q, k, v = (t[r, :, at : at + n] for t in (query, key, value))
            if rep > 1:
                k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
            scores = torch.matmul(q, k.transpose(1, 2)) * scale
            i = torch.arange(n, device=query.device)
            gap = i[:, None] - i[None, :]
            allowed = (gap >= 0) & (gap < window) if window is not None else gap >= 0
            scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
            sink = sinks.reshape(-1, 1, 1).to(scores.dtype).expand(heads, n, 1)
            logits = torch.cat([scores, sink], dim=-1)
            logits = logits - logits.max(dim=-1, keepdim=True).values
            probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]
            probs = F.dropout(probs, p=dropout, training=training).to(v.dtype)
            pieces.append(torch.matmul(probs, v).transpose(0, 1))
            at += n
        rows.append(torch.cat(pieces, dim=0) if len(pieces) > 1 else pieces[0])
    return torch.stack(rows)


def varlen_kwargs(
    names: frozenset[str], scale: float | None, head_dim: int
) -> tuple[dict[str, Any], float]:
    """``scale`` as this torch's ``varlen_attn`` takes it: ``({"scale": scale}, 1.0)`` where its
    signature has the keyword (torch 2.10+), else no keyword and the factor to multiply the
    query by so that its default ``1/sqrt(head_dim)`` gives ``scale`` (torch 2.9's has none)."""
    if "scale" in names:
        return {"scale": scale}, 1.0
    if scale is None:
        return {}, 1.0
    return {}, float(scale) * head_dim**0.5


def _varlen(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, segments: PackedSegments, *,
    scale: float | None, window: int | None,
) -> torch.Tensor:  # fmt: skip
    """torch's ``varlen_attn`` over the flattened tokens; ``(batch, seq, heads, head_dim)``."""
    call = _varlen_call()
    assert call is not None  # packed_route checked
    varlen_attn, names = call
    b, heads, s, d = query.shape
    q, k, v = (t.transpose(1, 2).reshape(b * s, t.shape[1], d) for t in (query, key, value))
    kwargs, factor = varlen_kwargs(names, scale, d)
    if factor != 1.0:  # a torch whose varlen_attn takes no scale: the query scaled instead
        q = q * factor
    if "window_size" in names:  # torch 2.13: causal is a window ending at the query
        kwargs["window_size"] = (-1 if window is None else window - 1, 0)
    else:  # older torch: an is_causal flag
        kwargs["is_causal"] = True
    if heads != key.shape[1]:
        if "enable_gqa" in names:
            kwargs["enable_gqa"] = True
        else:  # a torch without the flag: the key/value heads repeated (correct, not lean)
            rep = heads // key.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    cu, longest = segments.cu_seqlens(), segments.max_len
    out = varlen_attn(q, k, v, cu, cu, longest, longest, **kwargs)
    return out.view(b, s, heads, d)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention step of ``homelab_packed`` (see the module docstring); transformers'
    attention-function signature: q ``(batch, heads, seq, head_dim)``, k/v with the key/value
    heads; returns ``((batch, seq, heads, head_dim), None)``."""
    if not isinstance(attention_mask, PackedSegments) and kwargs.get("s_aux") is not None:
        return _eager_with_sinks(module, query, key, value, attention_mask, dropout, scaling)
    if not isinstance(attention_mask, PackedSegments):
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            sliding_window=sliding_window, **kwargs,
        )  # fmt: skip
    causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    if not causal:  # the mask step only makes segments for causal masks
        raise ValueError("homelab_packed: segments given to a non-causal attention")
    window = sliding_window if sliding_window and sliding_window > 0 else None
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # RoPE may have promoted q/k to fp32
        half = torch.get_autocast_dtype(device_type)
        query, key, value = (t if t.dtype == half else t.to(half) for t in (query, key, value))
    sinks = kwargs.get("s_aux")
    route = packed_route(query, key, dropout=dropout, window=window, sinks=sinks is not None)
    with _lock:
        _routes[route] += 1
    if route == "sinks":
        out = _with_sinks(query, key, value, attention_mask, sinks, scale=scaling,
                          dropout=dropout, window=window, training=module.training)  # fmt: skip
    elif route == "varlen":
        out = _varlen(query, key, value, attention_mask, scale=scaling, window=window)
    else:
        out = _per_sample(
            query, key, value, attention_mask, scale=scaling, dropout=dropout, window=window,
            causal=causal, repeat_kv=route == "sdpa-repeat-kv",
        )  # fmt: skip
    return out, None


def _eager_with_sinks(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    mask: torch.Tensor | None, dropout: float, scaling: float | None,
) -> tuple[torch.Tensor, Any]:  # fmt: skip
    """A model with attention sinks under any other mask (a KV cache, left padding): its own
    eager attention (which adds the sink), given the additive mask it expects in place of the
    boolean or absent one SDPA's mask step made (absent: causal, unless one query)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q_len, k_len = query.shape[2], key.shape[2]
    if mask is None and q_len > 1:
        i = torch.arange(q_len, device=query.device)[:, None] + (k_len - q_len)
        mask = torch.arange(k_len, device=query.device)[None, :] <= i
    if mask is not None:
        mask = mask[..., :k_len]
        if mask.dtype == torch.bool:
            low = torch.finfo(query.dtype).min
            mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~mask, low
            )
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    return eager_attention_forward(module, query, key, value, mask, scale, dropout=dropout)


def watch_positions(model: torch.nn.Module) -> torch.nn.Module:
    """Let the mask step see the ``position_ids`` of ``model``'s forward (its first
    ``…ForCausalLM`` module: under a peft or DDP wrapper too), so that a packed block's samples
    are found in a family whose forward keeps them from the mask builder (gpt-oss). Returns
    ``model``."""
    target = next((m for m in model.modules() if type(m).__name__.endswith("ForCausalLM")), None)
    if target is None or getattr(target, "_homelab_watches_positions", False):
        return model
    tokens: list[contextvars.Token[torch.Tensor | None]] = []

    def before(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
        pos = kwargs.get("position_ids")
        keep = pos if isinstance(pos, torch.Tensor) and pos.dim() == 2 else None
        tokens.append(_positions.set(keep))

    def after(module: Any, args: Any, kwargs: Any, output: Any) -> None:
        if tokens:
            _positions.reset(tokens.pop())

    target.register_forward_pre_hook(before, with_kwargs=True)
    target.register_forward_hook(after, with_kwargs=True, always_call=True)
    target._homelab_watches_positions = True
    return model


def _packing_found_on_host(find: Any) -> Any:
    """transformers' ``find_packed_sequence_indices`` (``find``) that, for the positions of
    `known_segments`, skips its "is anything packed?" check, a host sync a forward: the host
    knows (its segments, found by the same rule on the same positions). The same result."""

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> torch.Tensor | None:
        known = _known.get()
        if known is None or known[0] is not position_ids:
            return find(position_ids)
        if all(len(row) == 1 for row in known[1].lengths):
            return None
        first = position_ids[:, :1] - 1
        return (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)

    find_packed_sequence_indices.__wrapped__ = find  # type: ignore[attr-defined]
    return find_packed_sequence_indices


def register() -> str:
    """Register ``homelab_packed`` in transformers' attention and mask registries (once per
    process; before a model loads with it), and its packing check that reads nothing for
    `known_segments`' positions. Returns its name."""
    global _registered
    with _lock:
        if not _registered:
            from transformers import AttentionInterface, masking_utils
            from transformers.masking_utils import AttentionMaskInterface

            AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
            AttentionMaskInterface.register(PACKED_ATTENTION, packed_mask)
            find = getattr(masking_utils, "find_packed_sequence_indices", None)
            if find is not None and not hasattr(find, "__wrapped__"):
                masking_utils.find_packed_sequence_indices = _packing_found_on_host(find)
            _registered = True
    return PACKED_ATTENTION
