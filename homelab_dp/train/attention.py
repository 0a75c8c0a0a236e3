"""Which attention kernel the model loads with, and what each costs on packed batches.

Packed blocks (`homelab_dp.data.blocks`, pack = true) hold several samples, each with positions
restarting at 0; the worker passes those ``position_ids`` and no ``attention_mask``, and
transformers keeps attention within each sample by one of two routes:

- **sdpa** (and eager): `transformers.masking_utils` finds the restarts
  (``find_packed_sequence_indices``, only when the attention mask is None) and builds a
  block-diagonal causal mask: one ``(batch, 1, seq_len, seq_len)`` tensor per forward, shared
  by the layers (bool for sdpa, b·s² bytes; the model's dtype for eager). Because a mask is given, transformers' ``use_gqa_in_sdpa``
  declines SDPA's native GQA on CUDA, so each layer repeats the key/value heads to all query
  heads (``repeat_kv``: two ``(batch, heads, seq_len, head_dim)`` tensors per layer instead of
  ``kv_heads``), and SDPA may leave its flash kernel for the memory-efficient or math one.
- **flash_attention_2**: the positions become ``cu_seqlens`` and the varlen kernel attends
  within each sample; no mask and no repeated key/value heads are allocated. Note that
  transformers 5 takes this route from ``position_ids`` only for a batch of one row
  (``_is_packed_sequence`` checks ``batch_size == 1``): a micro-batch of several rows must be
  flattened to one row (rows start at position 0, so that stays exact) or given
  ``cu_seq_lens_q/k`` and ``max_length_q/k``; otherwise FlashAttention runs plain causal
  attention over each whole row and samples see each other.

Padded blocks (pack = false) pass their attention mask on either route.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

from homelab_dp.planning.attention_rule import FLASH_DTYPES, choose_attention, flash_attn_version

__all__ = [
    "FLASH_DTYPES",
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
) -> tuple[str, str]:
    """``(attn_implementation, why)``: `attention_implementation` and the sentence the start
    event records."""
    if capabilities is None:
        if device_type == "cuda" and capability is None:
            capability = local_capability()
        capabilities = (capability,)
    return choose_attention(device_type, dtype_name, capabilities, flash_attn_version())


def attention_implementation(
    device_type: str,
    dtype_name: str,
    *,
    capability: tuple[int, int] | None = None,
    capabilities: Sequence[tuple[int, int] | None] | None = None,
) -> str:
    """The ``attn_implementation`` to load the model with.

    ``"flash_attention_2"`` on CUDA in bf16/fp16 when the installed flash-attn distribution
    is a 2.x release and the card is compute capability 8.0 or newer (packed batches then need
    no mask; see the module docstring), else ``"sdpa"`` (`planning.attention_rule`).
    ``device_type`` is a torch device type ("cuda", "cpu"); ``dtype_name`` the run's dtype
    ("bf16", "fp16", "fp32", …), the dtype the attention computes in (under autocast the
    master weights may stay fp32; transformers casts q/k/v for the kernel). ``capability``:
    this rank's card (`local_capability` when not given, on CUDA); ``capabilities``: every
    card of the run instead. A card not known counts as too old.
    """
    return attention_choice(
        device_type, dtype_name, capability=capability, capabilities=capabilities
    )[0]
