"""Which attention kernel a run loads with, and whether packing is proven ahead (pure).

One rule for the plan (`homelab_dp.planning.plan_reasons`) and the worker
(`homelab_dp.train.model.attention`): FlashAttention-2 (``"flash_attention_2"``) only on CUDA, in
bf16/fp16, when every card is compute capability 8.0 (Ampere) or newer and the installed
``flash-attn`` distribution is a 2.x release; otherwise ``"homelab_packed"``
(`homelab_dp.train.model.packed_attention`): each sample of a packed block attends alone, through
torch's ``varlen_attn`` on a CUDA card of compute capability 8.0+ in bf16/fp16, else SDPA on
each sample's slice (the CPU: FlexAttention has no backward there); no block-diagonal mask and
no repeated key/value heads either way, and any other mask goes to SDPA unchanged. The FA2 kernels refuse older cards
at the first forward ("FlashAttention only supports Ampere GPUs or newer"), and transformers'
FA2 path imports the 2.x API: the ``flash-attn-4`` distribution also installs a ``flash_attn``
module, so a module that can be found says nothing about which one it is.

The installation is read from the distribution's metadata (`importlib.metadata`), never by
importing ``flash_attn`` (its import loads CUDA kernels).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from collections.abc import Sequence

from homelab_dp.planning.plan_hardware import PlanHardware
from homelab_dp.presets.preset import Preset

FLASH_MIN_CAPABILITY = (8, 0)
"""The oldest compute capability FlashAttention-2 runs on (Ampere)."""
FLASH_DTYPES = ("bf16", "fp16")
"""FlashAttention's kernels take half precision only."""
PACKED_ATTENTION = "homelab_packed"
"""The ``attn_implementation`` of `homelab_dp.train.model.packed_attention` (registered by the worker)."""
FLASH_DISTRIBUTION = "flash-attn"
"""The PyPI distribution of FlashAttention-2 (``pip install flash-attn``)."""


def flash_attn_version() -> str | None:
    """The installed ``flash-attn`` distribution's version, or None when it is not installed
    (or installed without its ``flash_attn`` module)."""
    try:
        version = importlib.metadata.version(FLASH_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        found = importlib.util.find_spec("flash_attn") is not None
    except (ImportError, ValueError):  # a broken or half-installed package
        found = False
    return version if found else None


def is_flash_attn_2(version: str | None) -> bool:
    """Whether ``version`` is a 2.x release of flash-attn ("2.7.4.post1": yes; "3.0.0b1",
    "1.0.9", None: no)."""
    if not version:
        return False
    return version.split(".", 1)[0].strip() == "2"


def _cap(capability: tuple[int, int] | None) -> str:
    return "unknown" if capability is None else f"{capability[0]}.{capability[1]}"


VARLEN_MAX_HEAD_DIM = 256
"""FlashAttention's largest head dimension."""
VARLEN_HEAD_DIM_MULTIPLE = 8
"""FlashAttention's kernels take a head dimension that is a multiple of 8 only."""
ROUTES = ("varlen", "sdpa", "sdpa-repeat-kv", "sinks")
"""The routes of ``homelab_packed`` on packed segments (`packed_kernel`)."""


def packed_kernel(
    device: str,
    dtype: str,
    capability: tuple[int, int] | None,
    head_dim: int,
    gqa: bool,
    *,
    dropout: bool = False,
    window: bool = False,
    varlen: bool = True,
    varlen_window: bool = True,
    sinks: bool = False,
) -> str:
    """The route ``homelab_packed`` takes on packed segments, one rule for the worker
    (`homelab_dp.train.model.packed_attention`) and the plan's memory count:

    - ``"varlen"``: torch's ``varlen_attn`` (FlashAttention) over the flattened tokens: CUDA,
      bf16/fp16 (the dtype the attention computes in, autocast's), compute capability 8.0+, a
      head dimension FlashAttention takes (at most 256, a multiple of 8), no dropout, a torch
      that has it (``varlen``) and its ``window_size`` when a window is asked.
    - ``"sdpa"``: SDPA on each sample's slice with the key/value heads shared (``enable_gqa``):
      the CPU, a model without grouped-query attention, or a card where SDPA's flash kernel
      runs (the only CUDA kernel besides the math one that takes GQA).
    - ``"sdpa-repeat-kv"``: SDPA on each sample's slice with that sample's key/value heads
      repeated to the query heads, so that the memory-efficient kernel runs where the flash
      kernel cannot (a card below 8.0, fp32, a head dimension it refuses, a window's band
      mask): with ``enable_gqa`` there torch falls to the math kernel, a heads × n² fp32
      matrix per sample saved for backward. The saved key/value are then query-wide.

    - ``"sinks"``: a model with attention sinks (gpt-oss: one learned logit per head in every
      softmax, `SINK_TYPES`): each sample's softmax over its keys and the sink, written out
      (no fused kernel takes the sink: FlashAttention-2 and SDPA drop it).

    ``capability`` None: a card of unknown capability, counted as new enough (the plan's rule
    for a what-if card; the worker always knows its card).
    """
    if sinks:
        return "sinks"
    half = device == "cuda" and dtype in FLASH_DTYPES
    new = capability is None or capability >= FLASH_MIN_CAPABILITY
    dim_ok = head_dim <= VARLEN_MAX_HEAD_DIM and head_dim % VARLEN_HEAD_DIM_MULTIPLE == 0
    flash = half and new and dim_ok
    if flash and not dropout and varlen and (varlen_window or not window):
        return "varlen"
    if device != "cuda" or not gqa or (flash and not window):
        return "sdpa"
    return "sdpa-repeat-kv"


def packed_route(
    device: str, dtype: str, capabilities: Sequence[tuple[int, int] | None], gqa: bool = True
) -> str:
    """How ``homelab_packed`` attends on ``device`` in ``dtype``, in words: torch's
    ``varlen_attn`` where every card is 8.0+ in bf16/fp16, else SDPA sample by sample (on CUDA
    with grouped-query key/value heads repeated, `packed_kernel`). A head dimension
    FlashAttention refuses also leaves varlen; the step event counts what ran."""
    if (
        device == "cuda"
        and dtype in FLASH_DTYPES
        and capabilities
        and all(c is not None and c >= FLASH_MIN_CAPABILITY for c in capabilities)
    ):
        return "torch's varlen_attn, each sample alone"
    if device == "cuda" and gqa:
        return "SDPA on each sample alone, grouped-query key/value heads repeated"
    return "SDPA on each sample alone"


SINK_TYPES = ("gpt_oss",)
"""``model_type``s with attention sinks (``s_aux``): FlashAttention-2 and SDPA ignore them, so
their every load (training, QLoRA, eval, chat, serving) attends through ``homelab_packed``,
which adds the sink logit (`packed_kernel`'s ``"sinks"``)."""


def has_sinks(model_type: str | None) -> bool:
    """Whether a model of ``model_type`` has attention sinks (`SINK_TYPES`)."""
    return model_type in SINK_TYPES


def inference_attention(model_type: str | None) -> str | None:
    """The ``attn_implementation`` a chat or serving replica loads ``model_type`` with: a model
    with attention sinks gets ``"eager"``, its own transformers attention, which adds them (the
    replica runs no packed blocks; FlashAttention-2 and SDPA would drop the sinks); None
    (transformers' default) otherwise."""
    return "eager" if has_sinks(model_type) else None


def choose_attention(
    device: str,
    dtype: str,
    capabilities: Sequence[tuple[int, int] | None] = (),
    flash_version: str | None = None,
    *,
    unknown_ok: bool = False,
    sinks: bool = False,
    gqa: bool = True,
) -> tuple[str, str]:
    """``(attn_implementation, why)`` for a run on ``device`` ("cuda", "cpu") in ``dtype``.

    ``capabilities``: the compute capability of every planned card (None: not known; counts as
    new enough when ``unknown_ok``, the plan's rule for a what-if card, else as too old).
    ``flash_version``: the installed flash-attn distribution's version (`flash_attn_version`).
    ``why`` is one sentence for the plan and the start event. Not FlashAttention-2:
    ``PACKED_ATTENTION`` (its route by `packed_route`). ``sinks``: the model has attention sinks
    (`has_sinks`): always ``PACKED_ATTENTION``, whose softmax takes them.
    """
    if sinks:
        return PACKED_ATTENTION, (
            f"{PACKED_ATTENTION} (each sample's softmax with its attention sink, no mask): the "
            "model has attention sinks, which FlashAttention-2 and SDPA drop"
        )
    lean = f"{PACKED_ATTENTION} ({packed_route(device, dtype, capabilities, gqa)}, no mask)"
    if device != "cuda":
        return (
            PACKED_ATTENTION,
            f"{lean}: FlashAttention-2 needs CUDA (this run is on the {device})",
        )
    if dtype not in FLASH_DTYPES:
        return (
            PACKED_ATTENTION,
            f"{lean}: FlashAttention-2 needs bf16 or fp16 (this run computes in {dtype})",
        )
    if flash_version is None:
        return (
            PACKED_ATTENTION,
            f"{lean}: flash-attn is not installed (pip install flash-attn for FA2)",
        )
    if not is_flash_attn_2(flash_version):
        return PACKED_ATTENTION, (
            f"{lean}: the installed flash-attn is {flash_version}, and transformers' "
            "flash_attention_2 needs a 2.x release"
        )
    need = FLASH_MIN_CAPABILITY
    old = [
        c for c in capabilities if (c is None and not unknown_ok) or (c is not None and c < need)
    ]
    if not capabilities or old:
        seen = ", ".join(dict.fromkeys(_cap(c) for c in old)) or "unknown"
        return PACKED_ATTENTION, (
            f"{lean}: FlashAttention-2 needs compute capability {_cap(need)} (Ampere) or newer "
            f"on every card, and a card here is {seen}"
        )
    return "flash_attention_2", (
        f"FlashAttention-2: flash-attn {flash_version} is installed and every card is compute "
        f"capability {_cap(need)} or newer"
    )


PACKING_PROVEN_FAMILIES = frozenset({
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma",
    "gemma2", "phi3", "granite", "olmo2", "gpt2",
})  # fmt: skip
"""``model_type``s whose transformers forward hands ``position_ids`` to the shared mask builder
(`transformers.masking_utils`), which turns the restarts of a packed block into a
block-diagonal mask; tests/unit/train/test_attention.py proves llama and gpt2 on the CPU. Another
family, or a model's own code (``trust_remote_code``), may attend across the samples of a
packed block: the worker checks it before training (`homelab_dp.train.model.packing_check`)."""


def attention_reason(
    hw: PlanHardware, dtype: str, flash_version: str | None = None, model_type: str | None = None,
    gqa: bool = True,
) -> str:  # fmt: skip
    """The attention kernel the worker will load with on ``hw``, and why
    (`homelab_dp.planning.attention_rule`; ``flash_version``: the installed flash-attn's version,
    read here when not given). A card of unknown capability counts as new enough (the worker
    decides on the card itself)."""
    version = flash_attn_version() if flash_version is None else flash_version
    caps = [d.compute_capability for d in hw.devices]
    _, why = choose_attention(
        hw.kind, dtype, caps, version, unknown_ok=True, sinks=has_sinks(model_type), gqa=gqa
    )
    return f"Attention: {why}."


def packing_reasons(preset: Preset, model_type: str) -> list[str]:
    """A warning when ``data.pack = true`` cannot be shown exact ahead: a model's own code
    (``trust_remote_code``) or a family not known to mask packed blocks by sample."""
    if not preset.data.pack:
        return []
    if preset.model.trust_remote_code:
        why = "the model runs its own code (model.trust_remote_code = true)"
    elif model_type not in PACKING_PROVEN_FAMILIES:
        why = f"model_type {model_type!r} is not a family known to mask packed blocks by sample"
    else:
        return []
    return [
        f"Warning: packing (data.pack = true) cannot be proven exact ahead: {why}; the worker "
        "compares one packed block with its samples run one by one before training and refuses "
        "to train if they differ (set data.pack = false to train on padded rows)."
    ]
