"""The strategy planner: which method and distribution, and why, for a model on some devices.

Decision tree (a pinned method, distribution or offload in the preset is respected):

1. Full fine-tune if it fits: DDP (every card holds everything; fastest), else ZeRO-1
   (optimizer state sharded), else FSDP grad-op (gradients and optimizer sharded), else FSDP
   full (everything sharded).
2. Else LoRA (frozen base, small adapters): DDP, else FSDP grad-op, else FSDP full.
3. Else QLoRA (4-bit base): DDP, else FSDP grad-op, else FSDP full (the packed 4-bit weights
   sharded, `homelab_dp.planning.memory.device_memory`).
4. Only when nothing above fits, not even on the same cards idle (memory others hold is waited
   for, not offloaded around), and `train.offload` / `train.offload_activations` are
   "auto"): the same options with offload to host RAM — the optimizer state or the sharded
   parameters (FSDP only), the saved activations (any distribution) — and of those that fit
   the one that moves the fewest bytes over PCIe per step (`homelab_dp.planning.memory.offload_cost` prices
   it). Never on the CPU, where the device is host RAM (a pinned offload is planned, at no
   cost).

Within each option activation checkpointing is tried off first, then on (when the preset says
"auto"), because it costs about a third more compute but no communication; with
`train.tiled_mlp` "auto" the same again with the MLP tiled (`planning.memory.mlp_tiles`),
only where nothing untiled fits: the MLP intermediate is what limits. Mixed cards are
limited by the smallest. When nothing fits, the plan says what would.

The words (the reasons for the choice, the advice when nothing fits, the learning-rate
scaling) are `homelab_dp.planning.plan_reasons`; the checks of what a preset may ask of the cards
`homelab_dp.planning.planner`; the answer's types and JSON `homelab_dp.planning.plan_result`. This
module decides and budgets.

The micro-batch search (pure arithmetic over a budget function): the largest micro-batch that
fits, the effective batch kept. The preset asks for an effective batch E = micro × world ×
accumulation. For a micro-batch m the accumulation is ceil(E / (m × world)), so the effective batch stays E when m × world divides E and
becomes the next multiple above it otherwise. By default only micro-batches that keep E exactly
are chosen (the learning rate, the schedule, the data position of checkpoints and the OOM retry
all assume it); a larger micro-batch that fits only by rounding E up is named in the plan, and
``exact=False`` takes it, saying so. Memory is not monotonic in m —
accumulation keeps every gradient alive during the backward pass, and a micro-batch large enough
to need none drops them — so every m from 1 to ceil(E / world) is budgeted (pure arithmetic,
microseconds each) and the largest that fits under the limit wins.

What a preset may ask of the planned hardware, checked before planning (pure).

The compute dtype the cards get (`resolve_dtype`), the attention kernel the worker will load
with (`attention_path`), and the pinned choices the planned hardware cannot train: FSDP in fp16
(`check_fp16_sharding`), and offload without FSDP (`check_offload`). Each refusal is a
`PresetError` naming the field, with a hint (the CLI prints ``error:`` and ``hint:``, exit 2).

`plan --find-micro-batch`: the plan at the largest micro-batch that fits, effective batch kept
(`search_micro_batch` applied to every option of the decision tree in order).

The plan's host-RAM step: the ``host`` block of a plan, and what to say when the machine cannot
hold the run although its cards can (pure; the model is `homelab_dp.planning.memory.host_memory`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from homelab_dp.byte_units import format_bytes
from homelab_dp.errors import PresetError
from homelab_dp.planning import grpo_plan
from homelab_dp.planning import sequence_split as split
from homelab_dp.planning.attention_rule import (
    FLASH_MIN_CAPABILITY,
    choose_attention,
    flash_attn_version,
)
from homelab_dp.planning.batch_shape import BatchShape
from homelab_dp.planning.memory.device_memory import TrainShape, budget, logits_bytes
from homelab_dp.planning.memory.host_memory import HostBudget, host_budget
from homelab_dp.planning.memory.memory_calibration import (
    HardwareCalibration,
    config_key,
    measured_reasons,
)
from homelab_dp.planning.memory.mlp_tiles import tiled_mlp_options, tiled_mlp_refusal, tiles_mlp
from homelab_dp.planning.memory.objective_memory import forward_rows
from homelab_dp.planning.memory.offload_cost import offload_cost
from homelab_dp.planning.micro_batch_search import search_micro_batch
from homelab_dp.planning.model_spec import ModelSpec
from homelab_dp.planning.objective_cost import (
    REFERENCE_OBJECTIVES,
    ObjectiveCost,
    objective_cost,
    resolve_reference,
)
from homelab_dp.planning.plan_hardware import PlanHardware
from homelab_dp.planning.plan_reasons import (
    choice_reasons,
    fit_advice,
    held_reasons,
    host_short_reasons,
    idle_advice,
    idle_choice_reason,
    lr_advice,
    lr_reasons,
    objective_reasons,
    overhead_terms,
)
from homelab_dp.planning.plan_result import SAFETY_MARGIN, Candidate, Fit, Plan
from homelab_dp.presets.preset import Preset
from homelab_dp.probe.hardware import BF16_MIN_CAPABILITY, format_capability
from homelab_dp.vocabulary import DISTRIBUTIONS, METHODS, SHARDED

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


EXPERT_TARGET_NAMES = ("experts", "experts.gate_up_proj", "experts.down_proj")
"""``lora.target_modules`` entries that name routed experts (`homelab_dp.train.model.lora`)."""


def names_experts(preset: Preset) -> bool:
    """Whether ``lora.target_modules`` names the routed experts."""
    targets = preset.lora.target_modules
    return not isinstance(targets, str) and any(t in EXPERT_TARGET_NAMES for t in targets)


def check_expert_adapters(spec: ModelSpec, preset: Preset) -> None:
    """QLoRA with adapters on routed experts: the experts are NF4 stacks there
    (`nf4_quantization.quantize_experts`), which have no 3-D weight for peft to adapt, so the adapters
    would not exist while the plan counted them: refused before launch (``method = "auto"``
    does not choose QLoRA then, `allowed_options`)."""
    if preset.train.method != "qlora" or spec.experts is None or not names_experts(preset):
        return
    raise PresetError(
        "lora.target_modules names the routed experts, and under QLoRA they are NF4 stacks "
        "peft cannot adapt: those adapters would not exist",
        hint="train.method = 'lora' adapts them (the experts stay 16-bit), or take 'experts' "
        "out of lora.target_modules for QLoRA",
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
    (`homelab_dp.planning.attention_rule.choose_attention`): FlashAttention-2 on CUDA in bf16/fp16
    when flash-attn 2.x is installed here and every planned card is compute capability 8.0 or
    newer (a what-if card of unknown capability counts as new enough), else SDPA. The memory
    model budgets the packed-attention mask of SDPA and none for FA2, so this must agree with
    what runs: a 2080 Ti with flash-attn installed trains with SDPA."""
    return choose_attention(device, dtype, capabilities, flash_attn_version(), unknown_ok=True)[0]


ORDER: tuple[tuple[str, str], ...] = (
    ("full", "ddp"),
    ("full", "zero1"),
    ("full", "fsdp-grad-op"),
    ("full", "fsdp-full"),
    ("lora", "ddp"),
    ("lora", "fsdp-grad-op"),
    ("lora", "fsdp-full"),
    ("qlora", "ddp"),
    ("qlora", "fsdp-grad-op"),
    ("qlora", "fsdp-full"),
)
"""The order in which the decision tree tries (method, distribution)."""


def train_shape(preset: Preset, hw: PlanHardware, method: str, dist: str, ckpt: bool, **kw: Any):
    """The memory model's shape of one option of ``preset`` on ``hw`` (``offload`` and
    ``offload_activations`` among ``kw``: none and False unless given). A preference objective's
    micro-batch of pairs becomes the forward's rows (`objective_memory.forward_rows`)."""
    targets = preset.lora.target_modules
    dtype = resolve_dtype(preset, hw)
    t = preset.train
    degree = split.degree_of(preset)  # a split sequence: each rank holds seq_len / degree
    rows, row_len = forward_rows(kw.get("micro_batch", t.micro_batch),
                                 split.split_len(kw.get("seq_len", preset.data.seq_len), degree),
                                 packed=preset.data.pack, objective=t.objective)  # fmt: skip
    share = kw.get("target_share", 1.0)
    if t.objective == "grpo":  # a prompt's completions: rows of prompt + completion tokens,
        # the loss normalising the completion tokens' logits only
        completion = preset.grpo.max_completion_tokens
        rows, row_len = rows * preset.grpo.generations, row_len + completion
        share = min(share, completion / row_len)
    return TrainShape(
        method=method,  # type: ignore[arg-type]
        distribution=dist,  # type: ignore[arg-type]
        world_size=hw.world_size,
        device=hw.kind,
        dtype=dtype,  # type: ignore[arg-type]
        micro_batch=rows,
        seq_len=row_len,
        grad_accum=kw.get("grad_accum", preset.train.grad_accum),
        activation_checkpointing=ckpt,
        optimizer=preset.train.optimizer,
        lora_r=preset.lora.r,
        lora_targets=targets if isinstance(targets, str) else tuple(targets),
        packed=preset.data.pack,
        attention=attention_path(hw.kind, dtype, [d.compute_capability for d in hw.devices]),  # type: ignore[arg-type]
        old_cards=any(
            c is not None and c < FLASH_MIN_CAPABILITY
            for c in (d.compute_capability for d in hw.devices)
        ),  # fmt: skip
        target_share=share,
        attention_span=kw.get("attention_span", 0.0),
        offload=kw.get("offload", "none"),
        offload_activations=kw.get("offload_activations", False),
        objective=t.objective,
        reference=resolve_reference(t.objective, t.reference, method),  # type: ignore[arg-type]
        sequence_parallel=degree,
        tiled_mlp=kw.get("tiled_mlp", False),
    )


def supported(
    method: str, dist: str, hw: PlanHardware, dtype: str | None = None, offload: str = "none"
) -> tuple[bool, str]:
    """Whether the worker can train ``method`` under ``dist`` on ``hw`` (and why not).

    ``dtype``: the compute dtype (`resolve_dtype`); fp16 on CUDA rules FSDP out. ``offload``
    of the optimizer or the parameters needs FSDP.
    """
    if method != "full" and dist == "zero1":
        return False, "ZeRO-1 saves nothing for LoRA: the adapters' optimizer state is tiny"
    if dist != "ddp" and hw.world_size == 1:
        return False, "sharding needs more than one device"
    if dtype == "fp16" and hw.kind == "cuda" and dist in SHARDED:
        return False, FP16_SHARDING_NOTE
    if offload != "none" and dist not in SHARDED:
        return False, f"train.offload = {offload!r} needs FSDP (its CPU offload moves shards)"
    return True, ""


def evaluate(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    method: str,
    dist: str,
    ckpt: bool,
    calibration: HardwareCalibration | None = None,
    **kw: Any,
) -> Candidate:
    """Budget one (method, distribution, checkpointing) option on ``hw``, with the offload
    ``kw`` names (``offload``, ``offload_activations``; none by default) and what it costs,
    and ``tiled_mlp`` (False by default; only where the model's MLPs can be tiled).

    A calibration of this hardware replaces the assumed overhead terms with measured ones.
    """
    overhead = calibration.overhead if calibration else None
    shape = train_shape(preset, hw, method, dist, ckpt, **kw)
    b = budget(spec, shape, overhead)
    if shape.objective == "grpo":  # generation, the reference forward, old log-probabilities
        b = grpo_plan.grpo_budget(spec, preset, shape, b, overhead)
    ok, note = supported(method, dist, hw, shape.dtype, shape.offload)
    fits = ok and b.total <= hw.budget(SAFETY_MARGIN)
    cost = offload_cost(spec, shape, b, hw)
    return Candidate(method, dist, ckpt, b, fits, ok, note, shape.offload,
                     shape.offload_activations, cost, tiled_mlp=tiles_mlp(spec, shape))  # fmt: skip


def checkpointing_options(preset: Preset) -> tuple[bool, ...]:
    setting = preset.train.activation_checkpointing
    return (False, True) if setting == "auto" else (bool(setting),)


def option_settings(spec: ModelSpec, preset: Preset) -> list[tuple[bool, bool]]:
    """(checkpointing, tiled MLP) in the tree's order for one option: untiled first."""
    tiles = tiled_mlp_options(spec, preset.train.tiled_mlp)
    return [(ck, tm) for tm in tiles for ck in checkpointing_options(preset)]


def allowed_options(preset: Preset) -> list[tuple[str, str]]:
    m, d = preset.train.method, preset.train.distribution
    pairs = [(mm, dd) for mm, dd in ORDER if (m == "auto" or mm == m) and (d == "auto" or dd == d)]
    t = preset.train
    if t.objective in REFERENCE_OBJECTIVES and t.reference == "adapters":
        # The reference is the base with the adapters disabled: a full fine-tune has none.
        pairs = [(mm, dd) for mm, dd in pairs if mm != "full"] or pairs
    if t.objective in REFERENCE_OBJECTIVES and t.reference == "copy":
        # The worker deep-copies the unsharded model of a full fine-tune.
        pairs = [(mm, dd) for mm, dd in pairs if mm == "full" and dd not in SHARDED] or pairs
    if m == "auto" and names_experts(preset):  # NF4 experts take no adapters
        pairs = [(mm, dd) for mm, dd in pairs if mm != "qlora"] or pairs
    if t.objective == "grpo":
        # Each rank decodes its own prompts (forwards of its own count): unsharded weights only;
        # the reference (beta > 0) is the base with the adapters off.
        pairs = [(mm, dd) for mm, dd in pairs
                 if dd == "ddp" and (preset.grpo.beta == 0 or mm != "full")] or pairs  # fmt: skip
    if not pairs:  # e.g. method=lora with distribution=zero1: plan it anyway, flagged unsupported
        pairs = [(m if m != "auto" else "full", d if d != "auto" else "ddp")]
    return pairs


def offload_stages(preset: Preset, hw: PlanHardware) -> list[list[tuple[str, bool]]]:
    """The (offload, offload_activations) settings the tree tries, stage by stage.

    First the least the preset allows (nothing, unless pinned); then, for what is "auto", every
    offload, which the tree tries only when nothing in the first stage fits. On the CPU
    offload moves nothing, so "auto" never chooses it (a pinned value is still planned). The
    optimizer state and the parameters go to the host only with AdamW (the worker steps it
    there: `presets.preset` refuses a pinned offload with another optimizer).
    """
    t = preset.train
    o, a = t.offload, t.offload_activations
    first = ("none" if o == "auto" else o, False if a == "auto" else bool(a))
    if hw.kind != "cuda":
        return [[first]]
    host_step = t.optimizer == "adamw"
    offs = (("none", "optimizer", "params") if host_step else ("none",)) if o == "auto" else (o,)
    acts = (False, True) if a == "auto" else (bool(a),)
    rest = [(oo, aa) for aa in acts for oo in offs if (oo, aa) != first]
    return [[first], rest] if rest else [[first]]


def option_stages(preset: Preset, hw: PlanHardware) -> list[list[tuple[str, str, str, bool]]]:
    """(method, distribution, offload, offload_activations) in the tree's order, by stage
    (`offload_stages`); offload of the optimizer or parameters under FSDP only."""
    pairs = allowed_options(preset)
    stages = []
    for settings in offload_stages(preset, hw):
        opts = [(m, d, o, a) for m, d in pairs for o, a in settings if o == "none" or d in SHARDED]
        if opts:
            stages.append(opts)
    return stages


def offloading(c: Candidate) -> bool:
    return c.offload != "none" or c.offload_activations


def _decide(spec, preset, hw, dtype, calibration, host_available, *, offload: bool = True):
    """The decision tree: (chosen or None, every candidate tried, the first stage's, the
    candidates refused for host RAM). In each stage the options go in the tree's order, each
    with checkpointing off then on; the fitting one that moves the fewest bytes over PCIe per
    step wins (without offload: the first that fits). ``offload`` False: the first stage only
    (what the preset pins, else nothing offloaded)."""
    settings = option_settings(spec, preset)
    tried: list[Candidate] = []
    first: list[Candidate] = []
    short: list[tuple[Candidate, int]] = []
    stages = option_stages(preset, hw)
    for i, stage in enumerate(stages if offload else stages[:1]):
        fitting: list[Candidate] = []
        for m, d, o, a in stage:
            if i and not supported(m, d, hw, dtype, o)[0]:
                continue  # a later stage lists only what could be chosen
            for ck, tm in settings:
                c = evaluate(spec, preset, hw, m, d, ck, calibration, offload=o,
                             offload_activations=a, tiled_mlp=tm)  # fmt: skip
                tried.append(c)
                need = _host_short(spec, preset, hw, c, host_available) if c.fits else None
                if need is not None:
                    short.append((c, need))
                elif c.fits:
                    fitting.append(c)
                    break
            if fitting and fitting[-1].budget.pcie_bytes_per_step == 0:
                break  # nothing crosses PCIe: the first that fits stands
        if i == 0:
            first = list(tried)
        if fitting:
            return min(fitting, key=lambda c: c.budget.pcie_bytes_per_step), tried, first, short
    return None, tried, first, short


def _host_short(spec, preset, hw, c: Candidate, available: int | None) -> int | None:
    """The host peak of an offloading option whose host RAM the machine cannot hold, else None
    (and None when the machine's RAM is not known)."""
    if available is None or not offloading(c):
        return None
    shape = _shape_of(preset, hw, c)
    host = host_budget(spec, shape, c.budget, merge=preset.train.merge, available=available)
    return None if host.fits else host.total_bytes


def plan(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    calibration: HardwareCalibration | None = None,
    *,
    host_available: int | None = None,
) -> Plan:
    """Run the decision tree for ``preset`` on ``hw`` (with what was measured on it, if known).

    ``host_available``: the machine's RAM, when known; an offloading option whose host RAM
    does not fit it is not chosen (`homelab_dp.planning.planner.with_host` passes it).
    Raises `PresetError` for a dtype the planned cards cannot train in (`resolve_dtype`), and
    for a pinned choice they cannot train (`check_fp16_sharding`, `check_offload`).
    """
    dtype = resolve_dtype(preset, hw)
    check_fp16_sharding(preset, hw, dtype)
    check_offload(preset, hw, dtype)
    check_expert_adapters(spec, preset)
    split.check_split(spec, preset, hw.world_size)  # a sequence too long for one card: split
    preset, split_line = split.choose_degree(spec, preset, hw.world_size, lambda p: (
        split.params_on_cards(_decide(spec, p, hw, dtype, calibration, host_available)[0])))  # fmt: skip
    # Memory other processes hold is waited for (`run --queue`), never offloaded around: offload
    # is tried only when the same cards, idle, would not hold the run without it either.
    offload = (
        not hw.limited(SAFETY_MARGIN)
        or _decide(spec, preset, hw.idle(), dtype, calibration, host_available, offload=False)[0]
        is None
    )
    chosen, tried, first, short = _decide(
        spec, preset, hw, dtype, calibration, host_available, offload=offload
    )
    usable = [c for c in tried if c.supported and all(c is not x for x, _ in short)]
    best_effort = chosen or min(usable, key=lambda c: c.budget.total, default=tried[-1])
    # Every candidate, each with the checkpointing setting the plan would use for it, under the
    # first stage's offload; and the chosen one, when it offloads more.
    settings = option_settings(spec, preset)
    off, acts = offload_stages(preset, hw)[0][0]
    candidates = []
    for method in METHODS:
        for dist in DISTRIBUTIONS:
            options = [evaluate(spec, preset, hw, method, dist, c, calibration, offload=off,
                                offload_activations=acts, tiled_mlp=tm)
                       for c, tm in settings]  # fmt: skip
            fitting = [c for c in options if c.fits]
            candidates.append(fitting[0] if fitting else options[-1])
    if _option_key(best_effort) not in {_option_key(c) for c in candidates}:
        candidates.append(best_effort)
    lr = lr_advice(preset, hw.world_size // split.degree_of(preset))  # the data ranks' batch
    later = chosen is not None and all(chosen is not c for c in first)
    reasons = choice_reasons(spec, preset, hw, best_effort, first if later else tried, dtype,
                             SAFETY_MARGIN, only_offload=later)  # fmt: skip
    reasons += host_short_reasons(short, host_available)
    objective = None
    if preset.train.objective not in (
        "sft",
        "grpo",
    ):  # what the objective costs (`planning.objective_cost`)
        shape = _shape_of(preset, hw, best_effort)
        objective = plan_objective(spec, preset, hw, best_effort)
        reasons += objective_reasons(objective, logits_bytes(spec, shape))
    grpo = None
    if preset.train.objective == "grpo":
        shape = _shape_of(preset, hw, best_effort)
        grpo = grpo_plan.grpo_memory(spec, preset, shape)
        reasons.append(grpo_plan.memory_reason(spec, preset, shape, best_effort.budget))
    reasons += [split_line] if split_line else []
    if preset.train.tiled_mlp == "on" and (why := tiled_mlp_refusal(spec)):
        reasons.append(f"train.tiled_mlp = 'on': {why}; the MLPs run as they are.")
    reasons = [*hw.notes, *reasons]  # what choosing the devices decided (a MIG slice) comes first
    advice: tuple[str, ...] = ()
    if not chosen:
        advice = tuple(
            fit_advice(spec, preset, hw, best_effort, evaluate, SAFETY_MARGIN, calibration)
        )
        if grpo is not None:  # which GRPO knob helps, each planned
            advice = (*grpo_plan.knob_advice(spec, preset, hw, best_effort, evaluate,
                                             hw.budget(SAFETY_MARGIN), calibration), *advice)  # fmt: skip
    idle = None
    if hw.limited(SAFETY_MARGIN):  # others hold memory: what would the same cards idle take?
        idle = plan(spec, preset, hw.idle(), calibration, host_available=host_available).chosen
        reasons += held_reasons(hw, SAFETY_MARGIN)
        if chosen and idle.fits and _option_key(idle) != _option_key(chosen):
            reasons.append(idle_choice_reason(idle))
        if not chosen and idle.fits:
            advice = (idle_advice(hw, SAFETY_MARGIN, idle), *advice)
    measured = None
    if calibration is not None and calibration.fingerprint:
        measured = calibration.match(measurement_key(spec, preset, hw, best_effort))
        reasons += measured_reasons(best_effort.budget.tensors, measured, calibration)
    return Plan(
        spec=spec,
        hardware=hw,
        chosen=best_effort,
        candidates=tuple(candidates),
        micro_batch=preset.train.micro_batch,
        grad_accum=preset.train.grad_accum,
        seq_len=preset.data.seq_len,
        dtype=dtype,
        lr=lr,
        reasons=tuple(reasons + lr_reasons(lr)),
        advice=advice,
        assumptions=tuple(overhead_terms(hw.kind, calibration.overhead if calibration else None)),
        calibration=calibration,
        measured=measured,
        idle=idle,
        objective=objective,
        grpo=grpo,
        sequence_parallel=split.degree_of(preset),
    )


def _shape_of(preset: Preset, hw: PlanHardware, c: Candidate) -> TrainShape:
    return train_shape(preset, hw, c.method, c.distribution, c.activation_checkpointing,
                       offload=c.offload, offload_activations=c.offload_activations,
                       tiled_mlp=c.tiled_mlp)  # fmt: skip


def plan_objective(
    spec: ModelSpec, preset: Preset, hw: PlanHardware, c: Candidate
) -> ObjectiveCost:
    """What ``preset``'s objective costs in option ``c`` (the ``objective`` block of
    `plan --json`; `homelab_dp.planning.objective_cost`): the resolved reference, the rows of a
    micro-batch, the extra no-grad forwards' share of a step, the precompute pass."""
    lora = preset.lora
    targets = (
        lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
    )
    return objective_cost(spec, _shape_of(preset, hw, c), micro_batch=preset.train.micro_batch,
                          seq_len=preset.data.seq_len, lora_r=lora.r, lora_targets=targets)  # fmt: skip


def _option_key(c: Candidate) -> tuple[str, str, bool, str, bool, bool]:
    return (c.method, c.distribution, c.activation_checkpointing, c.offload, c.offload_activations,
            c.tiled_mlp)  # fmt: skip


def _model_key(spec: ModelSpec) -> dict[str, Any]:
    return {**spec.summary(), "model_type": spec.model_type}


def measurement_key(spec: ModelSpec, preset: Preset, hw: PlanHardware, c: Candidate) -> dict:
    """The calibration key of candidate ``c`` (what `homelab-dp measure` stores). Offload that
    is off stays out of the key, so what was measured before offload existed still matches."""
    shape = _shape_of(preset, hw, c)
    key = config_key(_model_key(spec), shape)
    if shape.objective == "sft":  # what was measured before the objectives existed still matches
        key["shape"].pop("objective", None)
        key["shape"].pop("reference", None)
    if shape.offload == "none":
        key["shape"].pop("offload", None)
    if not shape.offload_activations:
        key["shape"].pop("offload_activations", None)
    if not shape.tiled_mlp:  # what was measured before tiled MLPs existed still matches
        key["shape"].pop("tiled_mlp", None)
    return key


def plan_largest_micro_batch(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    calibration: HardwareCalibration | None = None,
) -> Plan:
    """Plan with the largest micro-batch that fits, accumulation keeping the effective batch.

    The options are tried in the decision tree's order (full before LoRA before QLoRA,
    checkpointing off before on, offload only after every option without it); the first that
    fits at some micro-batch takes its largest.
    """
    if split.requested(preset) == "auto":  # the degree the tree picks at the preset's batch
        preset = split.with_degree(preset, plan(spec, preset, hw, calibration).sequence_parallel)
    t = preset.train
    asked = BatchShape.of(t.micro_batch, hw.world_size, t.grad_accum, split.degree_of(preset))
    data_world, requested = asked.ranks, asked.effective  # a split's ranks share blocks
    limit = hw.budget(SAFETY_MARGIN)  # on local cards others use: what is free, less a margin
    fit: Fit | None = None
    dtype = resolve_dtype(preset, hw)
    options = [o for stage in option_stages(preset, hw) for o in stage]
    for method, dist, off, acts in options:
        if not supported(method, dist, hw, dtype, off)[0]:
            continue
        for ckpt, tiled in option_settings(spec, preset):

            def total(
                micro: int, accum: int, m: str = method, d: str = dist, c: bool = ckpt,
                o: str = off, a: bool = acts, tm: bool = tiled,
            ) -> int:  # fmt: skip
                cand = evaluate(spec, preset, hw, m, d, c, calibration, micro_batch=micro,
                                grad_accum=accum, offload=o, offload_activations=a,
                                tiled_mlp=tm)  # fmt: skip
                return cand.budget.total

            found = search_micro_batch(total, limit, requested, data_world)
            fit = fit or found  # the first option's answer stands when none fits
            if found.fits:
                fit = found
                break
        if fit is not None and fit.fits:
            break
    if fit is None:  # nothing supported: plan as asked, the plan explains
        return plan(spec, preset, hw, calibration)
    # The lr was set for the preset's effective batch: keep that as the scaling reference.
    train = replace(t, micro_batch=fit.micro_batch, grad_accum=fit.grad_accum,
                    reference_batch=t.reference_batch or requested)  # fmt: skip
    p = plan(spec, replace(preset, train=train), hw, calibration)
    return replace(p, fit=fit, reasons=(*p.reasons, fit.describe()))


def with_host(p: Plan, preset: Preset, available: int | None) -> Plan:
    """``p`` with the host RAM its chosen option needs (`homelab_dp.planning.memory.host_memory.host_budget`).

    ``available``: the machine's available RAM (None: not known, not checked). When the machine
    cannot hold the peak, the plan does not fit; when that is all that does not fit, the
    "Chosen:" reason says why and the advice what would help (a plan already too big for its
    devices keeps its words: the host block still shows the figures).
    """
    host = _host(p, preset, p.chosen, available)
    if not host.fits and available is not None and offloading(p.chosen):
        # The choice offloads more than this machine can pin: plan again with its RAM known,
        # so that an option whose host RAM fits is chosen, if there is one.
        p = _replanned(p, preset, available)
        host = _host(p, preset, p.chosen, available)
    c = p.chosen
    if host.fits or not c.fits:
        return replace(p, host=host)
    problem, remedy = host_words(host, c.method, c.distribution)
    for other in p.candidates if host.peak_phase == "load" else ():
        # a sharded option of the same method that fits both (it loads one copy)
        if other.method != c.method or other.distribution not in SHARDED:
            continue
        if other.distribution == c.distribution or not other.fits:
            continue
        if _host(p, preset, other, available).fits:
            remedy = (f"train.distribution = {other.distribution!r} fits the devices and loads "
                      "one copy of the model (on rank 0); or free memory or add swap")  # fmt: skip
            break
    reasons = tuple(
        f"{r[:-1] if r.endswith('.') else r}, but the host RAM does not: {problem}."
        if r.startswith("Chosen:")
        else r
        for r in p.reasons
    )
    return replace(p, host=host, reasons=reasons, advice=(*p.advice, f"Host RAM: {remedy}."))


def _host(p: Plan, preset: Preset, c: Candidate, available: int | None) -> HostBudget:
    shape = train_shape(preset, p.hardware, c.method, c.distribution, c.activation_checkpointing,
                        micro_batch=p.micro_batch, grad_accum=p.grad_accum, offload=c.offload,
                        offload_activations=c.offload_activations,
                        tiled_mlp=c.tiled_mlp)  # fmt: skip
    return host_budget(p.spec, shape, c.budget, merge=preset.train.merge, available=available)


def _replanned(p: Plan, preset: Preset, available: int) -> Plan:
    """``p`` planned again knowing the machine's RAM (at its micro-batch and accumulation, as
    the micro-batch finder chose them: `homelab_dp.planning.planner`)."""
    t = preset.train
    if p.fit is not None:
        requested = BatchShape.of(t.micro_batch, p.hardware.world_size, t.grad_accum,
                                  p.sequence_parallel).effective  # fmt: skip
        t = replace(t, micro_batch=p.micro_batch, grad_accum=p.grad_accum,
                    reference_batch=t.reference_batch or requested)  # fmt: skip
    again = plan(
        p.spec, replace(preset, train=t), p.hardware, p.calibration, host_available=available
    )
    if p.fit is not None:
        again = replace(again, fit=p.fit, reasons=(*again.reasons, p.fit.describe()))
    return again


def host_words(host: HostBudget, method: str, distribution: str) -> tuple[str, str]:
    """(what the host RAM is short of, what would help) for a host peak that does not fit."""
    need, have = format_bytes(host.total_bytes), format_bytes(host.available_bytes or 0)
    phase, n = host.peak_phase, host.processes
    sharded = distribution in SHARDED
    if phase == "train":
        what = (f"training needs {need} on this machine ({n} processes × their offloaded state "
                "in pinned host memory, which cannot be swapped)")  # fmt: skip
        remedy = ("offload less (train.offload = 'optimizer' or 'none', "
                  "train.offload_activations = false), use more cards (smaller shards) "
                  "or free memory")  # fmt: skip
    elif phase == "load" and not sharded:
        what = f"loading needs {need} on this machine ({n} processes × a full copy)"
        remedy = (
            "use FSDP (train.distribution = 'fsdp-full' loads one copy, on rank 0), "
            "free memory or add swap"
            if method != "qlora"
            else "free memory or add swap"
        )
    elif phase == "load":
        what = f"loading needs {need} on this machine (rank 0 reads one full copy)"
        remedy = "free memory or add swap"
    elif phase == "checkpoint":
        what = f"saving the result needs {need} on this machine (rank 0 holds the whole model)"
        remedy = "free memory or add swap"
    else:
        what = f"merging the adapter needs {need} on this machine (rank 0 loads the base again)"
        remedy = "set train.merge = false (merge later, on a machine with more RAM) or add swap"
    return f"{what} but {have} is available", remedy
