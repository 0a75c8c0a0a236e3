"""Which attention kernel the model loads with, and what each costs on packed batches.

Packed blocks (`homelab_dp.data.blocks`, pack = true) hold several samples, each with positions
restarting at 0; the worker passes those ``position_ids`` and no ``attention_mask``, and the
attention keeps each sample to itself by one of these routes:

- **homelab_packed** (the default; `homelab_dp.train.model.packed_attention`, registered in
  transformers' attention and mask registries, so every family that uses them gets it): the
  mask step reads where the samples start (transformers' own mask function on adjacent tokens)
  and the attention runs per sample: torch's ``varlen_attn`` on a CUDA card of compute
  capability 8.0+ in bf16/fp16, SDPA on each sample's slice elsewhere (``is_causal``,
  ``enable_gqa``). No ``(batch, 1, seq_len, seq_len)`` mask, no repeated key/value heads, no
  work on the zeros of a block-diagonal mask. Right-padded rows (pack = false) are segments
  too; any other mask goes to SDPA unchanged.
- **sdpa** (the route before homelab_packed, still what transformers does with
  ``attn_implementation="sdpa"``): `transformers.masking_utils` builds a block-diagonal causal
  mask, b·s² bytes per forward, and because a mask is given ``use_gqa_in_sdpa`` declines SDPA's
  native GQA, so each layer repeats the key/value heads to all query heads (``repeat_kv``).
- **flash_attention_2**: the positions become ``cu_seqlens`` and the varlen kernel attends
  within each sample. transformers 5 takes this route from ``position_ids`` only for a batch of
  one row (``_is_packed_sequence`` checks ``batch_size == 1``): a micro-batch of several rows is
  flattened to one row (rows start at position 0, so that stays exact).

Padded blocks (pack = false) pass their attention mask on every route.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from homelab_dp.planning.attention_rule import (
    FLASH_DTYPES,
    PACKED_ATTENTION,
    choose_attention,
    flash_attn_version,
    has_sinks,
)

__all__ = [
    "FLASH_DTYPES",
    "PACKED_ATTENTION",
    "attention_choice",
    "attention_implementation",
    "flash_attn_available",
    "local_capability",
]


def flash_attn_available() -> bool:
    """Whether a ``flash_attn`` module can be found (never imported: importing it loads CUDA
    kernels). Not enough for FA2 on its own: flash-attn-4 provides the module too
    (`homelab_dp.planning.attention_rule`)."""
    try:
        return importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):  # a broken or half-installed package
        return False


def local_capability() -> tuple[int, int] | None:
    """The compute capability of this process's current CUDA card; None without one."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return int(major), int(minor)


def attention_choice(
    device_type: str,
    dtype_name: str,
    *,
    capability: tuple[int, int] | None = None,
    capabilities: Sequence[tuple[int, int] | None] | None = None,
    model_type: str | None = None,
) -> tuple[str, str]:
    """``(attn_implementation, why)``: `attention_implementation` and the sentence the start
    event records. ``homelab_packed`` is registered with transformers when chosen; a model with
    attention sinks (``model_type`` gpt_oss) always gets it (`planning.attention_rule`)."""
    if capabilities is None:
        if device_type == "cuda" and capability is None:
            capability = local_capability()
        capabilities = (capability,)
    name, why = choose_attention(
        device_type, dtype_name, capabilities, flash_attn_version(), sinks=has_sinks(model_type)
    )
    if name == PACKED_ATTENTION:
        from homelab_dp.train.model.packed_attention import register

        register()  # before any model loads with it (workers, eval, the streamed QLoRA load)
    return name, why


def attention_implementation(
    device_type: str,
    dtype_name: str,
    *,
    capability: tuple[int, int] | None = None,
    capabilities: Sequence[tuple[int, int] | None] | None = None,
    model_type: str | None = None,
) -> str:
    """The ``attn_implementation`` to load the model with.

    ``"flash_attention_2"`` on CUDA in bf16/fp16 when the installed flash-attn distribution
    is a 2.x release and the card is compute capability 8.0 or newer, else
    ``"homelab_packed"`` (registered here; see the module docstring and
    `planning.attention_rule`).
    ``device_type`` is a torch device type ("cuda", "cpu"); ``dtype_name`` the run's dtype
    ("bf16", "fp16", "fp32", …), the dtype the attention computes in (under autocast the
    master weights may stay fp32; transformers casts q/k/v for the kernel). ``capability``:
    this rank's card (`local_capability` when not given, on CUDA); ``capabilities``: every
    card of the run instead. A card not known counts as too old.
    """
    return attention_choice(
        device_type,
        dtype_name,
        capability=capability,
        capabilities=capabilities,
        model_type=model_type,
    )[0]
