"""What a preset may ask of the planned hardware, checked before planning (pure).

The compute dtype the cards get (`resolve_dtype`), the attention kernel the worker will load
with (`attention_path`), and the pinned choices the planned hardware cannot train: FSDP in fp16
(`check_fp16_sharding`), and offload without FSDP (`check_offload`). Each refusal is a
`PresetError` naming the field, with a hint (the CLI prints ``error:`` and ``hint:``, exit 2).
"""

from __future__ import annotations

from collections.abc import Sequence

from homelab_dp.core.attention_rule import choose_attention, flash_attn_version
from homelab_dp.core.hardware import BF16_MIN_CAPABILITY, PlanHardware, format_capability
from homelab_dp.core.preset import Preset
from homelab_dp.core.vocabulary import SHARDED
from homelab_dp.errors import PresetError

FP16_SHARDING_NOTE = (
    "FSDP needs bf16: the worker scales the fp16 loss (GradScaler) under DDP and ZeRO-1 only"
)
"""Why FSDP is not a candidate when the plan computes in fp16."""


def resolve_dtype(preset: Preset, hw: PlanHardware) -> str:
    """The compute dtype of ``preset`` on ``hw``, decided from the planned cards.

    fp32 on the CPU. On CUDA, "auto" is bf16 when every planned card has compute capability
    8.0 (Ampere) or newer, else fp16, which the worker trains with dynamic loss scaling (a
    GradScaler); a card whose capability is not known (a what-if ``--gpus 2x24GiB``, or NVML
    did not say) counts as new enough. A pinned dtype is kept, except that "bf16" on a card
    below 8.0 is a `PresetError` naming ``model.dtype`` and the card.
    """
    if hw.kind == "cpu":
        return "fp32"
    old = hw.below_capability(BF16_MIN_CAPABILITY)
    wanted = preset.model.dtype
    if wanted == "auto":
        return "fp16" if old else "bf16"
    if wanted == "bf16" and old:
        first = old[0]
        raise PresetError(
            f"model.dtype = 'bf16': {hw.label(first)} is compute capability "
            f"{format_capability(hw.devices[first].compute_capability)}, and bf16 needs "
            f"{format_capability(BF16_MIN_CAPABILITY)} (Ampere) or newer",
            hint='set model.dtype = "auto" (fp16 with loss scaling on this card) or "fp16", '
            "e.g. --set model.dtype=auto",
        )
    return wanted


def _fp16_why(preset: Preset, hw: PlanHardware) -> tuple[str, bool]:
    """Why the plan computes in fp16, and whether a card is too old for bf16."""
    old = hw.below_capability(BF16_MIN_CAPABILITY)
    why = (
        f"model.dtype = 'auto' gives fp16 on {hw.label(old[0])}, compute capability "
        f"{format_capability(hw.devices[old[0]].compute_capability)}"
        if preset.model.dtype == "auto" and old
        else f"model.dtype = {preset.model.dtype!r}"
    )
    return why, bool(old)


def check_fp16_sharding(preset: Preset, hw: PlanHardware, dtype: str) -> None:
    """A pinned FSDP distribution cannot train in fp16: refuse it before planning."""
    dist = preset.train.distribution
    if hw.kind != "cuda" or dtype != "fp16" or dist not in SHARDED:
        return
    why, old = _fp16_why(preset, hw)
    raise PresetError(
        f"train.distribution = {dist!r} cannot train in fp16 ({why}): {FP16_SHARDING_NOTE}",
        hint="set train.distribution = 'auto', 'ddp' or 'zero1' (fp16 with loss scaling)"
        + ("" if old else ", or model.dtype = 'bf16'"),
    )


def check_offload(preset: Preset, hw: PlanHardware, dtype: str) -> None:
    """A pinned ``train.offload`` of the optimizer or the parameters needs FSDP: refuse it with
    a pinned DDP or ZeRO-1, on one device (FSDP needs two or more), and in fp16 on CUDA (FSDP
    needs bf16). ``train.offload_activations`` works with any distribution."""
    off = preset.train.offload
    if off in ("auto", "none"):
        return
    field = f"train.offload = {off!r}"
    dist = preset.train.distribution
    keep = "or train.offload = 'none' (train.offload_activations = true works without FSDP)"
    if dist in ("ddp", "zero1"):
        raise PresetError(
            f"{field} needs FSDP, but train.distribution = {dist!r} keeps the weights whole on "
            "every device (FSDP2's CPU offload moves sharded state)",
            hint=f"set train.distribution = 'fsdp-full' (or 'fsdp-grad-op', or 'auto'), {keep}",
        )
    if hw.world_size < 2:
        raise PresetError(
            f"{field} needs FSDP, and FSDP needs two or more devices: this plan has one "
            f"({hw.label(0)})",
            hint=f"plan on two or more devices (hardware.devices, --gpus 2x24GiB), {keep}",
        )
    if hw.kind == "cuda" and dtype == "fp16":
        why, old = _fp16_why(preset, hw)
        raise PresetError(
            f"{field} cannot train in fp16 ({why}): offload needs FSDP, and {FP16_SHARDING_NOTE}",
            hint="set train.offload = 'none' (or 'auto')"
            + ("" if old else ", or model.dtype = 'bf16'"),
        )


def attention_path(device: str, dtype: str, capabilities: Sequence[tuple[int, int] | None]) -> str:
    """The attention kernel the worker will load with, by the worker's own rule
    (`homelab_dp.core.attention_rule.choose_attention`): FlashAttention-2 on CUDA in bf16/fp16
    when flash-attn 2.x is installed here and every planned card is compute capability 8.0 or
    newer (a what-if card of unknown capability counts as new enough), else SDPA. The memory
    model budgets the packed-attention mask of SDPA and none for FA2, so this must agree with
    what runs: a 2080 Ti with flash-attn installed trains with SDPA."""
    return choose_attention(device, dtype, capabilities, flash_attn_version(), unknown_ok=True)[0]
