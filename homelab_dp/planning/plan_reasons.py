"""The planner's explanations: what it says about a plan, in plain words.

Holds the text the planner attaches to a plan, apart from the decision itself (that stays in
`homelab_dp.planning.planner`):

- ``PLAIN``, the plain-words names of methods and distributions, and ``count``, a parameter
  count for people (the renderer and the TUI use both too);
- ``choice_reasons``: the hardware, what was rejected as too big, what was chosen and why;
- ``fit_advice``: when nothing fits, what would (shorter sequences, a smaller micro-batch,
  QLoRA, offload, larger or more cards), each checked with the same budget arithmetic;
- ``LrAdvice``, ``lr_advice`` and ``lr_reasons``: the learning rate scaled to the planned
  effective batch (linear and square-root rules).

The planner imports this module, so this one never imports the planner: it reads candidates
through the ``Option`` protocol and budgets what-ifs with the ``evaluate`` it is handed.

Memory other processes hold on the local cards: what the plan says about it.

What a plan budgets on a local card (`PlanDevice.budget`): the smaller of the planner's safety
margin of the whole card (95%) and the card's free memory at probe time less `free_margin`
(max(256 MiB, 2% of the card)), because other processes' memory moves between the probe and the
run's peak. On an idle card the 95% is the smaller, so idle cards plan as before; a desktop
session, an inference server or another fine-tune lowers it. What-if cards (``--gpus``) and the
CPU have no free memory recorded and keep budgeting the whole device.

When other processes make the plan smaller or make it not fit, the planner plans again on the
same cards idle (`PlanHardware.idle`) and these words say what that plan would be.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from homelab_dp.byte_units import format_bytes
from homelab_dp.planning.attention_rule import attention_reason, packing_reasons
from homelab_dp.planning.batch_shape import BatchShape
from homelab_dp.planning.memory.device_memory import (
    CPU_FRAGMENTATION,
    CPU_RUNTIME_BYTES,
    CUDA_CONTEXT_BYTES,
    CUDA_FRAGMENTATION,
    NCCL_BUFFER_BYTES,
    Budget,
    MiB,
    Overhead,
)
from homelab_dp.planning.memory.layer_kinds import installed_kernels, reference_path_note
from homelab_dp.planning.memory.memory_calibration import HardwareCalibration
from homelab_dp.planning.memory.offload_cost import OffloadCost, cost_words, offload_words
from homelab_dp.planning.model_spec import ModelSpec
from homelab_dp.planning.objective_cost import ObjectiveCost
from homelab_dp.planning.plan_hardware import PlanDevice, PlanHardware, free_margin
from homelab_dp.planning.sequence_split import degree_of
from homelab_dp.presets.preset import Preset
from homelab_dp.probe.hardware import BF16_MIN_CAPABILITY, GpuProcess, format_capability

PLAIN = {
    "full": "full fine-tune",
    "lora": "LoRA",
    "qlora": "QLoRA (4-bit base + LoRA)",
    "ddp": "DDP (each device holds a full copy)",
    "zero1": "ZeRO-1 (optimizer state split across cards)",
    "fsdp-grad-op": "FSDP grad-op (gradients and optimizer state split)",
    "fsdp-full": "FSDP full (weights, gradients and optimizer state split)",
}
"""Plain-words names of the methods and distributions."""


class Option(Protocol):
    """What the explanations read of one planner option (a `planner.Candidate`)."""

    @property
    def method(self) -> str: ...
    @property
    def distribution(self) -> str: ...
    @property
    def activation_checkpointing(self) -> bool: ...
    @property
    def budget(self) -> Budget: ...
    @property
    def fits(self) -> bool: ...
    @property
    def supported(self) -> bool: ...
    @property
    def offload(self) -> str: ...
    @property
    def offload_activations(self) -> bool: ...
    @property
    def offload_cost(self) -> OffloadCost | None: ...


Evaluate = Callable[..., Option]
"""The planner's `evaluate` (its signature is the planner's own): budget one (method,
distribution, checkpointing) option."""


@dataclass(frozen=True)
class LrAdvice:
    """Learning rate for the planned effective batch."""

    preset_lr: float
    reference_batch: int
    effective_batch: int
    linear: float
    sqrt: float
    rule: str
    applied: float
    warmup_steps: int
    unit: str = "sequences"
    """What the batch counts: sequences (SFT), pairs (DPO, ORPO) or completions (KTO)."""

    def to_json(self) -> dict[str, Any]:
        return {
            "preset": self.preset_lr,
            "reference_batch": self.reference_batch,
            "effective_batch": self.effective_batch,
            "linear": self.linear,
            "sqrt": self.sqrt,
            "rule": self.rule,
            "applied": self.applied,
            "warmup_steps": self.warmup_steps,
        }


def lr_advice(preset: Preset, world_size: int) -> LrAdvice:
    """Scaled learning rates when the effective batch differs from the reference batch."""
    t = preset.train
    effective = BatchShape(t.micro_batch, world_size, t.grad_accum).effective
    ref = t.reference_batch or effective
    ratio = effective / ref
    linear, sqrt = t.lr * ratio, t.lr * math.sqrt(ratio)
    applied = {"none": t.lr, "linear": linear, "sqrt": sqrt}[t.lr_scaling]
    unit = {"dpo": "pairs", "orpo": "pairs", "kto": "completions", "grpo": "prompts"}.get(
        t.objective, "sequences"
    )
    return LrAdvice(t.lr, ref, effective, linear, sqrt, t.lr_scaling, applied, t.warmup_steps, unit)


def lr_reasons(lr: LrAdvice) -> list[str]:
    """The effective batch, and the scaled learning rates when it is not the reference one."""
    out = [f"Effective batch {lr.effective_batch} {lr.unit} per optimizer step."]
    if lr.effective_batch != lr.reference_batch:
        out.append(
            f"The preset's lr {lr.preset_lr:g} was set for a batch of {lr.reference_batch}; for "
            f"{lr.effective_batch} the linear rule gives {lr.linear:.3g} and the square-root rule "
            f"{lr.sqrt:.3g} (using {lr.applied:.3g}, train.lr_scaling = {lr.rule!r}), "
            f"with {lr.warmup_steps} warm-up steps."
        )
    return out


def count(n: int) -> str:
    """A parameter count for people: 8.03B, 135M, 1.31M, 9.8K."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def layers_reason(spec: ModelSpec) -> str:
    """A model of layer groups in words: its layers per mixer kind, what carries a state."""
    kinds = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in spec.mixer_counts.items())
    state = (
        f"; {spec.state_layers} carry a recurrent or convolution state (a packed block must "
        "not carry it from one sample into the next)"
        if spec.state_layers
        else ""
    )
    extra = ", ".join(f"{k.replace('_', ' ')} {count(n)}" for k, n in spec.extras)
    return f"Layers by kind: {kinds}{state}. Memory and FLOPs are counted per layer kind" + (
        f"; outside the layers: {extra}." if extra else "."
    )


def model_reasons(spec: ModelSpec, method: str) -> list[str]:
    """What the plan counts for this model beyond a dense decoder, in words: a MoE model's
    experts (total against active parameters, and what QLoRA keeps in 16 bits), a
    pre-quantized checkpoint (what loads instead) and a frozen vision tower."""
    out: list[str] = []
    e = spec.experts
    if spec.blocks:
        out.append(layers_reason(spec))
    if e is not None:
        dense = spec.layers - e.layers
        where = f" in {e.layers} of {spec.layers} layers" if dense else ""
        shared = " and shared experts" if e.shared else ""
        out.append(
            f"MoE: {e.count} experts, top-k {e.top_k}{where}{shared}; {count(spec.params)} total, "
            f"{count(spec.active_params)} active parameters. Memory counts every expert's "
            "weights (and, trained, their gradients and optimizer state); FLOPs and MFU count "
            "the active ones."
        )
    if method == "qlora" and spec.quantizable_params < spec.params:
        kept = ["embeddings", "lm_head", "norms"]
        if e is not None:
            kept.insert(0, "the router")
        fused = sum(g.count * len(g.kind.nf4_kept(spec.model_type)) for g in spec.blocks)
        if fused:  # `model_layers.nf4_skip_modules`, as the worker loads it
            kept.append(
                f"Mamba's out_proj in {fused} layer{'s' if fused > 1 else ''}, which the fused "
                "mamba-ssm kernel reads as a 16-bit matrix"
            )
        if any(m.params for g in spec.blocks for m in g.kind.mixers):
            kept.append("the mixers' convolutions and state parameters (A_log, dt, D)")
        if spec.vision_params:
            kept.append("the vision tower")
        rest = spec.params - spec.quantizable_params
        out.append(
            f"QLoRA: {count(spec.quantizable_params)} parameters in 4-bit NF4"
            + (" (the routed experts included)" if e is not None else "")
            + f"; {count(rest)} stay 16-bit ({', '.join(kept)})."
        )
    if spec.quantization:
        q = spec.quantization
        if method == "qlora":
            how = f"its {q} weights are dequantized at load and re-quantized to NF4"
        else:
            how = f"its {q} weights are dequantized to the compute dtype at load"
        out.append(
            f"Pre-quantized checkpoint ({q}): {how}; the plan counts what loads, not the file."
        )
    if spec.vision_params:
        out.append(
            f"Vision tower: {count(spec.vision_params)} parameters loaded frozen (weights only: "
            "no gradients, no optimizer state); text training never runs it."
        )
    return out


OBJECTIVE_NAMES = {"dpo": "DPO", "orpo": "ORPO", "kto": "KTO"}
"""How the reasons name the preference objectives."""

REFERENCE_WORDS = {
    "adapters": "the base with the adapters disabled",
    "copy": "a frozen copy of the starting model on every device",
}
"""The reference models that cost a no-grad forward per micro-batch, in words."""


def objective_reasons(cost: ObjectiveCost, logits_bytes: int) -> list[str]:
    """What a preference objective costs, in words (nothing for SFT): the sequences per
    sample and the forward's rows, the full logits of both sequences (``logits_bytes``: the
    loss head at the backward's start), and the reference: its no-grad forward's share of the
    step (+x% compute), a copy's weights, or the precompute pass."""
    if cost.name not in OBJECTIVE_NAMES:
        return []
    name = OBJECTIVE_NAMES[cost.name]
    unit = "completion (itself and a mismatched KL completion)" if cost.name == "kto" else "pair"
    rows = f"{cost.rows_per_micro_batch} row{'s' if cost.rows_per_micro_batch > 1 else ''}"
    head = (
        f"{name}: {cost.sequences_per_sample} sequences per {unit}, so a micro-batch is {rows} "
        f"of {cost.row_len} tokens; the loss reads the full logits of both sequences "
        f"({format_bytes(logits_bytes)} per device at the backward's start, no chunked loss head)"
    )
    plus = f"+{100 * cost.extra_step_fraction:.0f}% step compute"
    kl = cost.name == "kto"
    if cost.reference == "none":
        return [f"{head}; no reference model."]
    if cost.reference == "precompute":
        share = f"{100 * (cost.precompute_share or 0):.0f}%"
        when = (f", about {cost.precompute_seconds:.0f} s"
                if cost.precompute_seconds is not None else "")  # fmt: skip
        ref = (f"reference = precomputed: one no-grad pass over the data before step 1 (forward "
               f"only: {share} of an epoch's training compute{when}), cached beside the token "
               "cache; nothing held while training")  # fmt: skip
        if kl:
            ref += f"; the KL forward, one no-grad forward per micro-batch ({plus})"
        return [f"{head}; {ref}."]
    what = REFERENCE_WORDS[cost.reference]
    extra = "two extra no-grad forwards (the reference's and the KL's)" if kl else (
        "one extra no-grad forward")  # fmt: skip
    ref = f"reference = {what}: {extra} per micro-batch ({plus})"
    if cost.reference_weight_bytes:
        ref += f", and its weights: {format_bytes(cost.reference_weight_bytes)} per device"
    return [f"{head}; {ref}."]


def _describe(c: Option) -> str:
    ck = " with activation checkpointing" if c.activation_checkpointing else ""
    ck += " and the MLP in tiles along the sequence" if getattr(c, "tiled_mlp", False) else ""
    off = offload_words(c.offload, c.offload_activations)
    return f"{PLAIN[c.method]} with {PLAIN[c.distribution]}{ck}" + (f", {off}" if off else "")


def _cards(hw: PlanHardware, positions: Sequence[int]) -> str:
    """The devices at ``positions``, each distinct kind once: "GPU 0 (Tesla P40)", or the name
    alone for a set of identical cards."""
    labels: list[str] = []
    seen: set[tuple[str, tuple[int, int] | None]] = set()
    for i in positions:
        d = hw.devices[i]
        if (d.name, d.compute_capability) in seen:
            continue
        seen.add((d.name, d.compute_capability))
        same = sum(
            1
            for e in hw.devices
            if (e.name, e.compute_capability) == (d.name, d.compute_capability)
        )
        labels.append(d.name if same > 1 or not hw.indices else hw.label(i))
    return " and ".join(labels)


def dtype_reasons(preset: Preset, hw: PlanHardware, dtype: str) -> list[str]:
    """Why the plan computes in ``dtype`` on CUDA when the preset leaves it to the planner
    (``model.dtype = "auto"``), and what fp16 rules out; nothing on the CPU (always fp32) or for
    a pinned bf16/fp32."""
    if hw.kind != "cuda":
        return []
    out: list[str] = []
    if preset.model.dtype == "auto":
        old = hw.below_capability(BF16_MIN_CAPABILITY)
        unknown = hw.unknown_capability()
        if old:
            parts = list(
                dict.fromkeys(  # one part per distinct kind of card, in order
                    f"{_cards(hw, [i])} is compute capability "
                    f"{format_capability(hw.devices[i].compute_capability)}"
                    for i in old
                )
            )
            have = "has" if len(parts) == 1 else "have"
            out.append(f"fp16 with loss scaling: {' and '.join(parts)}, which {have} no bf16.")
        elif unknown:
            assumed = f"so {format_capability(BF16_MIN_CAPABILITY)} or newer (Ampere) is assumed"
            if hw.source.startswith("--gpus") and len(unknown) == hw.world_size:
                out.append(
                    f"bf16: the what-if cards' compute capability is not known, {assumed}; "
                    "name it for older cards, e.g. --gpus 2x11GiB@7.5."
                )
            elif hw.source.startswith("--gpus"):
                out.append(
                    f"bf16: the compute capability of {_cards(hw, unknown)} is not known, "
                    f"{assumed}; name it for older cards, e.g. 24GiB@7.5."
                )
            else:
                out.append(
                    f"bf16: NVML did not give the compute capability of {_cards(hw, unknown)}, "
                    f"{assumed}; set model.dtype = 'fp16' if it is older."
                )
        else:
            out.append(
                f"bf16: every card is compute capability >= "
                f"{format_capability(BF16_MIN_CAPABILITY)}."
            )
    if dtype == "fp16" and hw.world_size > 1 and preset.train.distribution == "auto":
        out.append(
            "FSDP is left out: it needs bf16, and the worker scales the fp16 loss "
            "(GradScaler) under DDP and ZeRO-1 only."
        )
    return out


def choice_reasons(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    chosen: Option,
    tried: Sequence[Option],
    dtype: str,
    margin: float,
    *,
    only_offload: bool = False,
) -> list[str]:
    """Why ``chosen``: the hardware, each option rejected as too big, and the verdict.

    ``tried`` is every option the decision tree budgeted, in order; ``margin`` is the fraction
    of the smallest device's memory a plan may use (less on a local card that others use:
    `PlanHardware.budget`). ``only_offload``: nothing in ``tried`` (every option without
    offload) fits, and ``chosen`` fits only with offload; the verdict says so and what it costs.
    """
    cap = hw.min_memory
    usable = hw.budget(margin)
    n = hw.world_size
    where = f"{n} CPU process{'es' if n > 1 else ''}" if hw.kind == "cpu" else f"{n} GPU(s)"
    if hw.limited(margin):  # other processes hold memory: the free memory limits the plan
        why = "usable: what is free less a margin, see below"
    else:
        why = f"usable after a {int(round((1 - margin) * 100))}% margin"
    out = [
        f"{count(spec.params)} parameters ({spec.model_type}), {where}, "
        f"{format_bytes(cap)} on the smallest device ({format_bytes(usable)} {why}), "
        f"compute in {dtype}."
    ]
    out += model_reasons(spec, chosen.method)
    note = reference_path_note(spec, installed_kernels(), hw.kind)
    if note:
        out.append(note)
    out += dtype_reasons(preset, hw, dtype)
    if hw.kind == "cuda":
        out.append(
            attention_reason(hw, dtype, model_type=spec.model_type, gqa=spec.kv_heads != spec.heads)
        )
    out += packing_reasons(preset, spec.model_type)
    if len({d.memory_bytes for d in hw.devices}) > 1:
        out.append(
            "Mixed cards: every card gets the same share, so the smallest one limits the plan."
        )
    t = preset.train
    pinned = [
        f"{k} = {v!r}"
        for k, v in (("method", t.method), ("distribution", t.distribution),
                     ("offload", t.offload), ("offload_activations", t.offload_activations))
        if v != "auto"
    ]  # fmt: skip
    if pinned:
        out.append("The preset pins " + " and ".join(pinned) + "; only that was considered.")
    # One line per (method, distribution) rejected, with its smallest budget.
    rejected: dict[tuple[str, str], Option] = {}
    for cand in tried:
        if cand is chosen:
            break
        own = (cand.method, cand.distribution) == (chosen.method, chosen.distribution)
        if cand.supported and (not own or only_offload):  # without offload: its own too
            rejected[(cand.method, cand.distribution)] = cand  # the last one tried is smallest
    for cand in rejected.values():
        ck = " even with activation checkpointing" if cand.activation_checkpointing else ""
        out.append(
            f"Too big: {PLAIN[cand.method]} with {PLAIN[cand.distribution]} needs "
            f"{format_bytes(cand.budget.total)} per device{ck}."
        )
    total = chosen.budget.total
    verdict = "fits" if chosen.fits else "does NOT fit"
    of = f"{100 * total / cap:.0f}% of {format_bytes(cap)}"
    if hw.limited(margin):
        of = f"{100 * total / max(usable, 1):.0f}% of the {format_bytes(usable)} usable"
    cost = chosen.offload_cost
    paid = ""
    if cost is not None:
        paid = "; only offload makes it fit" if only_offload and chosen.fits else "; offload"
        paid += f": {cost_words(cost)}"
    out.append(
        f"Chosen: {_describe(chosen)} — {format_bytes(total)} per device at the {chosen.budget.peak_phase} "
        f"peak, {verdict} ({of}){paid}."
    )
    if chosen.distribution != "ddp" and chosen.fits:
        out.append(
            f"Sharding moves {format_bytes(chosen.budget.comm_bytes_per_step)} per device per step "
            "over the links between cards; NVLink or fast PCIe helps."
        )
    return out


def host_short_reasons(short: Sequence[tuple[Option, int]], available: int | None) -> list[str]:
    """One line per offloading option that fits the cards but not the machine's host RAM
    (each with its host peak, bytes)."""
    seen: set[str] = set()
    out = []
    for c, need in short:
        if (what := _describe(c)) in seen:
            continue
        seen.add(what)
        out.append(
            f"Host RAM: {what} fits the cards but needs {format_bytes(need)} of host RAM, "
            f"more than the {format_bytes(available or 0)} available."
        )
    return out


def _offload_advice(
    spec: ModelSpec, preset: Preset, hw: PlanHardware, best: Option, evaluate: Evaluate,
    calibration: HardwareCalibration | None,
) -> str | None:  # fmt: skip
    """Offload that would make ``best``'s method fit when the preset's pins kept it out."""
    t = preset.train
    if hw.kind != "cuda" or best.offload != "none" or best.offload_activations:
        return None
    ck = t.activation_checkpointing in ("auto", True)
    tries = [(d, "params", False) for d in ("fsdp-full", "fsdp-grad-op") if hw.world_size > 1]
    tries.append((best.distribution, "none", True))
    for dist, off, acts in tries:
        c = evaluate(spec, preset, hw, best.method, dist, ck, calibration, offload=off,
                     offload_activations=acts)  # fmt: skip
        if not (c.supported and c.fits and c.offload_cost):
            continue
        sets = [f"train.offload = {off!r}"] if off != "none" else []
        sets += ["train.offload_activations = true"] if acts else []
        if dist != best.distribution:
            sets.append(f"train.distribution = {dist!r}")
        return (f"Offload fits: {', '.join(sets)} — {format_bytes(c.budget.total)} per device; "
                f"{cost_words(c.offload_cost)}.")  # fmt: skip
    return None


def fit_advice(
    spec: ModelSpec,
    preset: Preset,
    hw: PlanHardware,
    best: Option,
    evaluate: Evaluate,
    margin: float,
    calibration: HardwareCalibration | None = None,
) -> list[str]:
    """What would make the run fit, each checked with the same budget arithmetic.

    ``best`` is the smallest option that did not fit; ``evaluate`` budgets the what-ifs and
    ``margin`` is the fraction of the smallest device's memory a plan may use (`hw.budget`).
    """
    m, d, ck = best.method, best.distribution, best.activation_checkpointing
    usable = hw.budget(margin)
    out: list[str] = []
    t = preset.train

    def fits(**kw: Any) -> bool:
        c = evaluate(spec, preset, hw, m, d, ck, calibration, offload=best.offload,
                     offload_activations=best.offload_activations, **kw)  # fmt: skip
        return c.budget.total <= usable

    seq = preset.data.seq_len
    while seq > 16 and not fits(seq_len=seq):
        seq //= 2
    if seq < preset.data.seq_len and fits(seq_len=seq):
        out.append(f"Shorter sequences: data.seq_len = {seq} fits (now {preset.data.seq_len}).")
    asked = BatchShape.of(t.micro_batch, hw.world_size, t.grad_accum, degree_of(preset))
    for micro in range(t.micro_batch - 1, 0, -1):
        smaller = asked.with_micro(micro)
        if smaller is None:
            continue  # the effective batch would change: the lr and schedule were set for it
        if fits(micro_batch=micro):
            out.append(
                f"Smaller micro-batch with more accumulation: train.micro_batch = {micro}, "
                f"train.grad_accum = {smaller.accum} (effective batch {smaller.effective})."
            )
            break
    if t.objective in ("dpo", "kto") and t.reference == "copy":
        # The frozen copy is a whole model on every device; precomputing holds nothing.
        pre = replace(preset, train=replace(t, reference="precompute"))
        # Without offload first: what the plan would then choose if it fits.
        for off in (("none", False), (best.offload, best.offload_activations)):
            c = evaluate(spec, pre, hw, m, d, ck, calibration, offload=off[0],
                         offload_activations=off[1])  # fmt: skip
            if c.budget.total <= usable:
                break
        if c.budget.total <= usable:
            out.append(f"Precomputed reference: train.reference = 'precompute' fits "
                       f"({format_bytes(c.budget.total)} per device): one no-grad pass over "
                       "the data before step 1 instead of a frozen copy on every device.")  # fmt: skip
    if m != "qlora" and preset.train.method not in ("auto", "qlora"):
        for qd in ("ddp", "fsdp-grad-op", "fsdp-full"):
            q = evaluate(spec, preset, hw, "qlora", qd, True)
            if q.fits:
                dist = "" if qd == "ddp" else f", train.distribution = {qd!r}"
                out.append(f"QLoRA fits: {format_bytes(q.budget.total)} per device "
                           f"(train.method = 'qlora'{dist}).")  # fmt: skip
                break
    if (line := _offload_advice(spec, preset, hw, best, evaluate, calibration)) is not None:
        out.append(line)
    need = best.budget.total / margin
    out.append(f"Larger cards: this plan needs {format_bytes(need)} per device.")
    if hw.kind == "cuda" and m == "full":
        size = hw.min_memory
        for n in range(hw.world_size + 1, 17):
            more = replace(hw, devices=tuple(hw.idle().devices[:1]) * n)  # other cards, idle
            c = evaluate(spec, preset, more, "full", "fsdp-full", True)
            if c.fits:
                out.append(
                    f"More cards: {n} × {format_bytes(size)} fit a full fine-tune with FSDP full "
                    f"sharding ({format_bytes(c.budget.total)} per card)."
                )
                break
    if len(out) == 1:
        fixed = best.budget.weights + best.budget.optimizer + best.budget.buffers
        out.insert(
            0,
            "Neither shorter sequences nor a smaller micro-batch is enough: weights and optimizer "
            f"state alone need {format_bytes(fixed)} per device, before activations and runtime.",
        )
    return out


def overhead_terms(device: str, measured: Overhead | None = None) -> list[str]:
    """Plain-words description of the overhead terms (shown in every plan)."""
    if measured is not None and measured.source != "assumed":
        what = "CUDA context and NCCL buffers" if device == "cuda" else "Python/torch runtime"
        return [
            f"{what} {measured.runtime_bytes // MiB} MiB per process ({measured.source})",
            f"allocator fragmentation {measured.fragmentation * 100:.0f}% of tensors "
            f"({measured.fragmentation_source})",
        ]
    if device == "cuda":
        return [
            f"CUDA context {CUDA_CONTEXT_BYTES // MiB} MiB (assumed)",
            f"NCCL buffers {NCCL_BUFFER_BYTES // MiB} MiB when more than one card (assumed)",
            f"allocator fragmentation {int(CUDA_FRAGMENTATION * 100)}% of tensors (assumed)",
        ]
    return [
        f"Python/torch runtime {CPU_RUNTIME_BYTES // MiB} MiB per process (assumed)",
        f"allocator slack {int(CPU_FRAGMENTATION * 100)}% of tensors (assumed)",
    ]


def process_text(p: GpuProcess) -> str:
    """A process in words: ``python3 (pid 48211, 6.00 GiB)``, or ``another homelab-dp run: ID
    (pid …, …)`` for one of ours."""
    used = format_bytes(p.used_bytes) if p.used_bytes is not None else "memory n/a"
    who = f"another homelab-dp run: {p.run_id}" if p.run_id else p.name or "unknown process"
    return f"{who} (pid {p.pid}, {used})"


def holders(d: PlanDevice) -> str:
    """Who holds memory on ``d``: its processes, or why none are named."""
    if d.processes:
        return ", ".join(process_text(p) for p in d.processes)
    if d.processes is None:
        return "processes NVML does not list (no permission, or not supported)"
    return "no listed process (the driver, or processes in another container)"


def held_reasons(hw: PlanHardware, margin: float) -> list[str]:
    """One line per local card whose budget is cut by what others hold on it."""
    out = []
    for i in hw.limited(margin):
        d = hw.devices[i]
        free = d.free_bytes or 0
        out.append(
            f"{hw.label(i)}: {format_bytes(d.held_bytes)} of {format_bytes(d.memory_bytes)} in "
            f"use by {holders(d)}; the plan budgets the {format_bytes(free)} free less a "
            f"{format_bytes(free_margin(d.memory_bytes))} margin: {format_bytes(d.budget(margin))}."
        )
    return out


def _held_by(hw: PlanHardware, positions: Sequence[int]) -> str:
    """Per card: ``6.25 GiB held on GPU 1 (…) by python3 (pid 48211, 6.00 GiB)``."""
    return "; ".join(
        f"{format_bytes(hw.devices[i].held_bytes)} held on {hw.label(i)} by "
        f"{holders(hw.devices[i])}"
        for i in positions
    )


def _option(c: Option) -> str:
    ck = "with" if c.activation_checkpointing else "without"
    return f"{PLAIN[c.method]} with {PLAIN[c.distribution]}, {ck} activation checkpointing"


def idle_advice(hw: PlanHardware, margin: float, idle: Option) -> str:
    """Why a plan that does not fit now would fit the same cards idle (``idle`` fits there):
    the cards whose budget is below what that plan needs, and who holds memory there."""
    limited = hw.limited(margin)
    need = idle.budget.total
    blocking = [i for i in limited if hw.devices[i].budget(margin) < need] or limited
    return (
        f"Fits when the other processes are gone: {_held_by(hw, blocking)}. On the idle "
        f"cards: {_option(idle)}, {format_bytes(idle.budget.total)} per device."
    )


def idle_choice_reason(idle: Option) -> str:
    """Why the plan chose something else than it would on the same cards idle."""
    return (
        f"On idle cards the plan would be {_option(idle)} "
        f"({format_bytes(idle.budget.total)} per device); the memory others hold (above) rules "
        "it out."
    )
