"""``data.pack = true`` proven on the real model before training, or refused.

A packed block holds several samples, each with positions restarting at 0, and no attention
mask (`homelab_dp.train.model.attention`). It is exact only when the model's forward hands those
``position_ids`` to transformers' mask builder (which then keeps attention within each sample)
or takes FlashAttention-2's one-row varlen route. A family with its own mask code, a forward
that drops ``position_ids``, or a model's own code (``trust_remote_code``) silently lets every
token attend to the samples before it in the block: the loss trains on contaminated attention
and nothing looks wrong.

`check_packing` runs one tiny packed block of three short samples through the model exactly as
the training loop sends it, and the same samples one by one (one row each, positions from 0, no
padding), and compares every token's logits. Equal within the compute dtype's tolerance
(`TOLERANCE`, relative to the largest logit) the run trains packed; otherwise the run is
refused before its first step with an ``error:`` naming the model type and the fix
(``data.pack = false``: padded rows, one sample each, always exact). Refusing rather than
silently unpacking keeps the plan's memory and step count true: unpacked rows are a different
run (more blocks, more steps) than the one planned.

The check is deterministic (fixed token ids, dropout off for its forwards, no gradients) and
costs four forward passes of at most 20 tokens. Every rank runs it with the same inputs, so a
wrapped model's forward (FSDP2 gathers weights in it) meets the same collectives everywhere.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from homelab_dp.errors import HomelabError

SAMPLE_LENGTHS = (6, 9, 5)
"""The check's samples: short, different lengths, so each later one starts mid-block."""
TOLERANCE = {"fp64": 1e-9, "fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}
"""Largest logit difference (relative to the largest logit magnitude, at least 1) that still
counts as equal: reduction order differs between a block and a sample alone, so packed and one
by one agree only to the compute dtype's rounding. Attention across samples moves the logits of
the later samples by far more (tests/unit/train/test_packing_check.py)."""


@dataclass(frozen=True)
class PackingCheck:
    """What `check_packing` found on one model."""

    verdict: str
    """"exact" (the packed block gave every sample's own logits) or "differs"."""
    max_diff: float
    """The largest absolute logit difference, packed against one by one."""
    tolerance: float
    """The largest that counts as equal (``TOLERANCE`` × the logits' scale)."""
    model_type: str

    @property
    def exact(self) -> bool:
        return self.verdict == "exact"


def sample_ids(vocab_size: int, lengths: tuple[int, ...] = SAMPLE_LENGTHS) -> list[list[int]]:
    """Fixed token ids for the check's samples (no special tokens: ids from 3 up)."""
    gen = torch.Generator().manual_seed(1234)
    high = max(4, min(vocab_size, 32000))
    return [torch.randint(3, high, (n,), generator=gen).tolist() for n in lengths]


@contextlib.contextmanager
def _eval_mode(model: nn.Module) -> Iterator[None]:
    """Dropout off for the check's forwards (LoRA dropout too), the previous mode back after."""
    was = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was)


def _logits(
    model: nn.Module,
    ids: list[int],
    positions: list[int],
    device: torch.device,
    autocast: Callable[[], Any],
) -> torch.Tensor:
    """One row through ``model`` as the loop sends a packed row: positions, no mask."""
    x = torch.tensor([ids], dtype=torch.long, device=device)
    pos = torch.tensor([positions], dtype=torch.long, device=device)
    with autocast():
        out = model(input_ids=x, attention_mask=None, position_ids=pos, use_cache=False)
    return out.logits[0].float()


def check_packing(
    model: nn.Module,
    *,
    device: torch.device,
    dtype: str,
    model_type: str,
    vocab_size: int,
    autocast: Callable[[], Any] = contextlib.nullcontext,
) -> PackingCheck:
    """Compare one packed block with its samples run one by one on ``model`` (see the module
    docstring). ``dtype``: the run's compute dtype ("fp32", "bf16", …), for the tolerance;
    ``autocast``: the loop's forward context."""
    samples = sample_ids(vocab_size)
    packed_ids = [t for s in samples for t in s]
    packed_pos = [p for s in samples for p in range(len(s))]
    with torch.no_grad(), _eval_mode(model):
        packed = _logits(model, packed_ids, packed_pos, device, autocast)
        alone = torch.cat(
            [_logits(model, s, list(range(len(s))), device, autocast) for s in samples]
        )
    scale = max(1.0, float(alone.abs().max()))
    tol = TOLERANCE.get(dtype, TOLERANCE["fp32"]) * scale
    diff = float((packed - alone).abs().max())
    ok = diff <= tol  # NaN (a forward that overflows) never passes
    return PackingCheck("exact" if ok else "differs", diff, tol, model_type)


def loop_autocast(device: torch.device, dtype: str, fsdp: bool) -> Callable[[], Any]:
    """The forward context the loop will use (`train.loop.rank_setup.build_model`): autocast to bf16/fp16
    on CUDA without FSDP2 (whose MixedPrecisionPolicy casts), else none."""
    if getattr(device, "type", device) != "cuda" or dtype not in ("bf16", "fp16") or fsdp:
        return contextlib.nullcontext
    half = torch.bfloat16 if dtype == "bf16" else torch.float16
    return lambda: torch.autocast("cuda", dtype=half)


def check_model(model: nn.Module, *, device: torch.device, dtype: str, fsdp: bool) -> PackingCheck:
    """`check_packing` of a loaded (possibly wrapped) model with the loop's autocast, its
    model_type and vocabulary read from its config; raises `HomelabError` when it differs."""
    config = model.config
    check = check_packing(
        model, device=device, dtype=dtype, model_type=str(getattr(config, "model_type", "?")),
        vocab_size=int(config.vocab_size), autocast=loop_autocast(device, dtype, fsdp),
    )  # fmt: skip
    require_exact_packing(check)
    return check


def require_exact_packing(check: PackingCheck) -> None:
    """Refuse to train packed when the check found attention across samples."""
    if check.exact:
        return
    raise HomelabError(
        f"data.pack = true is not exact on this model (model_type {check.model_type!r}): a "
        f"packed block's logits differ from its samples run one by one by {check.max_diff:.3g} "
        f"(tolerance {check.tolerance:.3g}), so samples would see each other (attention "
        "across samples, or a recurrent layer's state carried from one into the next)",
        hint="set data.pack = false (padded rows, one sample each), e.g. --set data.pack=false",
    )
