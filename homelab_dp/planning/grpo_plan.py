"""GRPO in the plan: generation's memory in every option's budget, its time in the prediction,
and the knob that helps a plan that does not fit (pure arithmetic).

**Memory** (`grpo_budget`; `homelab_dp.planning.planner.evaluate` applies it to every
candidate, so the decision tree, the fit check and the micro-batch finder all see it). The SFT
budget of the training rows (`micro_batch × generations` rows of ``data.seq_len +
max_completion_tokens`` tokens on the plain logits path) gains, per rank:

* a **generate** phase, before the step's training forward, as
  `homelab_dp.train.objectives.grpo_generation.generate_group` runs it: the model states at
  rest (weights, the optimizer state, DDP's buckets, QLoRA's dequantization buffers), one
  group's KV cache (`kv_cache_bytes`: ``generations × (prompt + max_completion_tokens)``
  tokens in the compute width) and, at the prompt's forward, transformers' logits of every
  prompt position (``generations × prompt × V``) or one layer's tensors, whichever is larger;
  while decoding, each step's last-position logits and the sampler's fp32 copies
  (``generations × V × (w + 16)``: scores, probabilities, top-p's sorted copy and its
  cumulative sum). The cache is freed before the training forward, so this phase is the peak
  only when the cache outgrows the training's activations and logits.
* the **reference forward** when ``grpo.beta > 0``: after the policy's forward (its
  activations and its fp32 log-softmax rows saved), one no-grad forward of the same rows with
  the adapters off, whose peak is its own logits head or one layer's tensors
  (`homelab_dp.train.objectives.grpo.GrpoObjective.micro_step`), and its fp32
  log-probabilities kept to the backward.
* the **old policy's log-probabilities** when ``grpo.iterations > 1``: fp32 per completion
  token of every prompt the rank holds in a step, alive through the step's passes.

**Time** (`with_generation`; `homelab_dp.planning.speed_plan.predict_candidate` applies it to
every candidate's prediction). Decoding is bound by memory bandwidth, not FLOPs: every new
token of a group (its ``generations`` rows together) reads every weight once and the group's
KV cache so far (its mean, half the completion), plus a fixed cost per layer (the kernels'
launches and the Python of an eager forward, which dominates small models); the prompt's
forward is priced by its FLOPs at the time model's achieved rate (or its weights' reads, if
longer) plus the same fixed cost. A step decodes ``prompts per
rank`` groups of ``max_completion_tokens`` tokens: an upper bound, a group ends when all its
completions have. The weights a decode step reads (`decode_weight_bytes`): QLoRA's 4-bit base
is dequantized per linear for a batch of rows (bitsandbytes' 4-bit matrix-vector kernel serves
one row only), so each weight costs its packed bytes, a 16-bit write and a 16-bit read; a
full fine-tune's fp32 master weights are cast by autocast each forward (a 4-byte read, a write
and a read in the compute width); LoRA's 16-bit base is read once; the input embeddings are
looked up, not read whole. The card's bandwidth comes from `homelab_dp.planning.flops`'s
table (`memory_bandwidth`) times `CUDA_DECODE_BANDWIDTH_SHARE`; the CPU's is
`CPU_DECODE_BYTES_PER_S`, shared by the processes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

from homelab_dp.byte_units import format_bytes
from homelab_dp.planning.flops import (
    causal_span,
    memory_bandwidth,
    no_grad_forward_flops_per_token,
)
from homelab_dp.planning.memory.device_memory import (
    NF4_BYTES_PER_PARAM,
    Budget,
    Overhead,
    assumed_overhead,
    device_states,
    layer_activation_bytes,
)
from homelab_dp.planning.memory.grpo_memory import kv_cache_bytes
from homelab_dp.planning.memory.objective_memory import preference_head_bytes
from homelab_dp.planning.memory.train_shape import TrainShape, compute_width
from homelab_dp.planning.model_spec import ModelSpec
from homelab_dp.planning.plan_hardware import PlanHardware
from homelab_dp.planning.speed_calibration import CPU_THREAD_SCALING
from homelab_dp.presets.preset import Preset

CUDA_DECODE_BANDWIDTH_SHARE = 0.8
"""Share of a card's peak memory bandwidth a decode step's reads achieve: large sequential
reads of weights reach 80–90% of the datasheet figure on current cards (assumed, the lower
end)."""
UNKNOWN_BANDWIDTH = 936.2e9
"""A card the bandwidth table does not know is priced as an RTX 3090 (936 GB/s), as the time
model prices its FLOPs (`homelab_dp.planning.time_model.UNKNOWN_PEAK_FLOPS`)."""
CUDA_DECODE_LAYER_S = 1.0e-3
"""Fixed seconds per decoder layer of one eager decode step on CUDA (kernel launches and
Python; a small model's decode is bound by this, not by bandwidth). From PyTorch's
"Accelerating Generative AI with PyTorch II: GPT, Fast" (2023): an eager LLaMA-7B decodes 25.5
tokens/s on an A100, 39 ms a token where its 13.5 GB of weights read at 1.5 TB/s take 9 ms;
the rest, 30 ms over 32 layers, is about 1 ms a layer. Assumed for every card."""
CPU_DECODE_BYTES_PER_S = 10e9
"""Bytes a second the CPU's decode steps read, every process together (assumed: a desktop's
dual-channel DDR4/DDR5 reaches 20–60 GB/s with every core streaming; eager decoding streams
less). Irrelevant for the tiny models the CPU path trains, whose decode is bound by
`CPU_DECODE_LAYER_S`."""
CPU_DECODE_LAYER_S = 1.8e-3
"""Fixed seconds per decoder layer of one decode step of a CPU process with
`CPU_DECODE_THREADS` threads, sampling included (Python, dispatch, small kernels). Measured on
the 2-core development machine: ``python benchmarks/grpo_speed.py`` (tiny-grpo, 4 layers:
7.7 ms a decode step on 1 process, docs/grpo.md); a busier or slower machine is slower."""
CPU_DECODE_THREADS = 2
"""The threads of the process `CPU_DECODE_LAYER_S` was measured with; a process with fewer
is slower as the time model's compute is (`homelab_dp.planning.speed_calibration.
CPU_THREAD_SCALING`: the square root of the threads)."""
SAMPLER_FP32_COPIES = 4
"""fp32 tensors of vocabulary size per row while sampling a token (`sample_next`: the
scores, the probabilities, top-p's sorted copy and its cumulative sum)."""


@dataclass(frozen=True)
class GrpoMemory:
    """What GRPO adds to one rank's memory in an option (bytes; the ``grpo`` block of
    ``plan --json``)."""

    engine: str
    """What generates: "transformers" (the project's batched KV-cache decoder over
    transformers' model forward); a colocated vLLM engine is the seam's next name."""
    kv_cache_bytes: int
    """One group's cache at its longest: generations × (prompt + max_completion_tokens)."""
    prompt_forward_bytes: int
    """The prompt's no-grad forward beyond its cache: its logits or one layer's tensors."""
    sampling_bytes: int
    """A decode step's logits and the sampler's fp32 copies."""
    generate_phase_bytes: int
    """Tensor bytes at generation's peak (model states included)."""
    reference_bytes: int
    """beta > 0: the reference forward's peak beyond the policy's forward, and its
    log-probabilities; 0 otherwise."""
    old_logps_bytes: int
    """iterations > 1: the old policy's log-probabilities of the step; 0 otherwise."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class GrpoTime:
    """One rank's generation in a step (the time model's part for GRPO)."""

    seconds: float
    groups: int
    """Prompts the rank generates for in a step (one group each)."""
    decode_steps: int
    """Decode steps of the step (groups × max_completion_tokens: an upper bound)."""
    generated_tokens: int
    """Tokens the rank generates in a step at full length (decode steps × generations)."""
    weight_bytes: float
    """Bytes of weights one decode step reads (`decode_weight_bytes`)."""
    kv_bytes: float
    """The group's mean KV cache one decode step reads."""
    bandwidth: float
    """Bytes/s those reads achieve."""
    bandwidth_source: str
    layer_seconds: float
    """The fixed cost of a layer in a decode step."""
    prompt_seconds: float
    """The prompts' forwards of the step."""

    @property
    def seconds_per_decode_step(self) -> float:
        return (self.seconds - self.prompt_seconds) / self.decode_steps if self.decode_steps else 0


def geometry(preset: Preset, shape: TrainShape) -> tuple[int, int, int, int]:
    """(generations, prompt tokens, completion tokens, prompts a rank holds per micro-step)
    of a GRPO ``shape`` (whose rows are prompts × generations)."""
    g = preset.grpo
    return (g.generations, preset.data.seq_len, g.max_completion_tokens,
            max(1, shape.micro_batch // g.generations))  # fmt: skip


def generation_bytes(spec: ModelSpec, preset: Preset, shape: TrainShape) -> dict[str, int]:
    """The generate phase's tensors beyond the model states: ``kv`` (the full cache),
    ``prompt`` (the prompt's forward), ``sampling`` (a decode step's head), ``extra`` (the
    most of them alive at once: the prompt's forward beside the prompt's cache, or a decode
    step's head beside the full cache)."""
    gens, prompt, completion, _ = geometry(preset, shape)
    w = compute_width(shape)
    kv_full = kv_cache_bytes(spec, gens, prompt + completion, w)
    kv_prompt = kv_cache_bytes(spec, gens, prompt, w)
    logits = gens * prompt * spec.vocab * w + gens * spec.vocab * 4
    layer = int(layer_activation_bytes(spec, shape) * gens * prompt)
    prompt_fwd = max(logits, layer)
    sampling = gens * spec.vocab * (w + 4 * SAMPLER_FP32_COPIES)
    extra = max(kv_prompt + prompt_fwd, kv_full + sampling)
    return {"kv": kv_full, "prompt": prompt_fwd, "sampling": sampling, "extra": extra}


def grpo_memory(spec: ModelSpec, preset: Preset, shape: TrainShape) -> GrpoMemory:
    """GRPO's additions to ``shape``'s memory (see the module docstring)."""
    gen = generation_bytes(spec, preset, shape)
    s = device_states(spec, shape)
    rest = s["weights"] + s["opt"] + s["buffers"] + s["resident"]
    return GrpoMemory(
        engine=engine_of(preset),
        kv_cache_bytes=gen["kv"],
        prompt_forward_bytes=gen["prompt"],
        sampling_bytes=gen["sampling"],
        generate_phase_bytes=int(rest + gen["extra"]),
        reference_bytes=_reference(spec, preset, shape)[0],
        old_logps_bytes=_old_logps(preset, shape),
    )


def engine_of(preset: Preset) -> str:
    """The engine ``grpo.engine`` names ("auto": transformers, the only one this version has;
    `homelab_dp.train.objectives.grpo_generation.engine_name` refuses another)."""
    setting = preset.grpo.engine
    return "transformers" if setting == "auto" else setting


def _old_logps(preset: Preset, shape: TrainShape) -> int:
    if preset.grpo.iterations <= 1:
        return 0
    _, _, completion, _ = geometry(preset, shape)
    return shape.micro_batch * shape.grad_accum * completion * 4


def _reference(spec: ModelSpec, preset: Preset, shape: TrainShape) -> tuple[int, int]:
    """(the reference forward's bytes beyond the policy's forward peak, its kept
    log-probabilities); (0, 0) when beta is 0."""
    if preset.grpo.beta <= 0:
        return 0, 0
    _, _, completion, _ = geometry(preset, shape)
    tokens = shape.micro_batch * shape.seq_len
    head = preference_head_bytes(spec, shape)
    peak = max(head["forward"], int(layer_activation_bytes(spec, shape) * tokens))
    kept = shape.micro_batch * completion * 4
    # The policy's logits are gone by then, its saved fp32 rows are not.
    return peak + head["saved"] - head["forward"] + kept, kept


def grpo_budget(
    spec: ModelSpec, preset: Preset, shape: TrainShape, b: Budget, overhead: Overhead | None
) -> Budget:
    """``b`` (the SFT-style budget of GRPO's training rows) with generation, the reference
    forward and the old log-probabilities (see the module docstring); its peak is the largest
    phase."""
    s = device_states(spec, shape)
    gen = generation_bytes(spec, preset, shape)
    ref_extra, ref_kept = _reference(spec, preset, shape)
    old = _old_logps(preset, shape)
    rest = s["weights"] + s["opt"] + s["buffers"]
    generate = rest + s["resident"] + gen["extra"]
    # The policy's forward peak (its logits beside its saved activations) is in phases; the
    # reference forward follows it.
    reference = b.phases["forward"] + ref_extra + old if ref_extra else 0
    train = b.tensors + ref_kept + old
    phases = dict(b.phases)
    phases["forward"] = max(phases["forward"] + old, reference)
    phases["backward"] = phases["backward"] + ref_kept + old
    phases["generate"] = int(generate)
    ov = overhead or assumed_overhead(shape.device, shape.world_size)
    if generate > max(train, reference):
        parts = (s["weights"], s["resident"], s["opt"], gen["extra"] - gen["sampling"],
                 gen["sampling"], s["buffers"])  # fmt: skip
        if gen["extra"] != gen["kv"] + gen["sampling"]:  # the prompt's forward is the peak
            kv_prompt = gen["extra"] - gen["prompt"]
            parts = (s["weights"], s["resident"], s["opt"], kv_prompt, gen["prompt"],
                     s["buffers"])  # fmt: skip
        phase = "generate"
    elif reference > train:
        held = s["accum_grads"] + s["resident"]
        logits = ref_extra + old + preference_head_bytes(spec, shape)["forward"]
        acts = reference - rest - held - logits
        parts = (s["weights"], held, s["opt"], acts, logits, s["buffers"])
        phase = "forward"
    else:
        parts = (b.weights, b.gradients, b.optimizer, b.activations,
                 b.logits + ref_kept + old, b.buffers)  # fmt: skip
        phase = b.peak_phase
    ints = [int(p) for p in parts]
    return replace(b, weights=ints[0], gradients=ints[1], optimizer=ints[2],
                   activations=ints[3], logits=ints[4], buffers=ints[5],
                   overhead=int(ov.bytes_for(sum(ints))), peak_phase=phase,
                   phases={k: int(v) for k, v in phases.items()})  # fmt: skip


def decode_weight_bytes(spec: ModelSpec, shape: TrainShape) -> float:
    """Bytes of weights one decode step reads (see the module docstring): every weight but
    the input embeddings (a tied lm_head is read as the head)."""
    w = compute_width(shape)
    base_w = w if shape.device == "cuda" else 4
    head = spec.lm_head_params or spec.embedding_params
    read = spec.params - spec.embedding_params - spec.lm_head_params + head
    if shape.method == "qlora":
        q = spec.quantizable_params
        return q * (NF4_BYTES_PER_PARAM + 2 * base_w) + (read - q) * base_w
    if shape.method == "full" and shape.device == "cuda" and w != 4:
        return read * (4 + 2 * w)  # autocast's cast of the fp32 master weights
    return read * base_w


def decode_bandwidth(hw: PlanHardware, world_size: int) -> tuple[float, str]:
    """(bytes/s a decode step's reads achieve on the slowest planned device, where it comes
    from)."""
    if hw.kind == "cpu":
        return (CPU_DECODE_BYTES_PER_S / max(1, world_size),
                f"assumed {CPU_DECODE_BYTES_PER_S / 1e9:.0f} GB/s for the machine, shared by "
                f"{world_size} process(es)")  # fmt: skip
    known = [memory_bandwidth(d.name) for d in hw.devices]
    if all(k is not None for k in known):
        peak = min(k for k in known if k is not None)
        return (peak * CUDA_DECODE_BANDWIDTH_SHARE,
                f"{peak / 1e9:,.0f} GB/s (the card's datasheet) × "
                f"{CUDA_DECODE_BANDWIDTH_SHARE:.0%} achieved")  # fmt: skip
    return (UNKNOWN_BANDWIDTH * CUDA_DECODE_BANDWIDTH_SHARE,
            "the card is not in the bandwidth table: an RTX 3090's 936 GB/s × "
            f"{CUDA_DECODE_BANDWIDTH_SHARE:.0%} assumed")  # fmt: skip


def decode_layer_seconds(kind: str, threads: int | None) -> float:
    """The fixed cost of one layer of a decode step: `CUDA_DECODE_LAYER_S`, or on the CPU
    `CPU_DECODE_LAYER_S` scaled to ``threads`` threads a process."""
    if kind != "cpu":
        return CUDA_DECODE_LAYER_S
    return CPU_DECODE_LAYER_S * (CPU_DECODE_THREADS / max(1, threads or CPU_DECODE_THREADS)) ** (
        CPU_THREAD_SCALING
    )


def generation_time(
    spec: ModelSpec, preset: Preset, shape: TrainShape, hw: PlanHardware, flops_per_s: float,
    threads: int | None = None,
) -> GrpoTime:  # fmt: skip
    """One rank's generation seconds in a step of ``shape`` (see the module docstring);
    ``flops_per_s``: the time model's achieved rate of the slowest device (the prompts'
    forwards); ``threads``: a CPU process's threads."""
    gens, prompt, completion, per_micro = geometry(preset, shape)
    groups = per_micro * shape.grad_accum
    w = compute_width(shape)
    weights = decode_weight_bytes(spec, shape)
    kv_mean = kv_cache_bytes(spec, gens, prompt + completion // 2, w)
    bandwidth, source = decode_bandwidth(hw, shape.world_size)
    layer_s = decode_layer_seconds(hw.kind, threads)
    fixed = spec.layers * layer_s
    step = (weights + kv_mean) / bandwidth + fixed
    prompt_flops = no_grad_forward_flops_per_token(spec, attention_span=causal_span(prompt))
    prompt_compute = prompt_flops * gens * prompt / flops_per_s if flops_per_s else 0.0
    prompt_s = max(prompt_compute, weights / bandwidth) + fixed
    seconds = groups * (prompt_s + completion * step)
    return GrpoTime(seconds=seconds, groups=groups, decode_steps=groups * completion,
                    generated_tokens=groups * completion * gens, weight_bytes=weights,
                    kv_bytes=kv_mean, bandwidth=bandwidth, bandwidth_source=source,
                    layer_seconds=layer_s, prompt_seconds=groups * prompt_s)  # fmt: skip


def _time_of(spec: ModelSpec, preset: Preset, shape: TrainShape, hw: PlanHardware,
             pred: Any) -> GrpoTime:  # fmt: skip
    """`generation_time` at the prediction's achieved rate and threads."""
    flops = float((pred.assumptions.get("achieved_flops_per_s") or {}).get("value") or 0.0)
    threads = pred.assumptions.get("threads_per_process")
    return generation_time(spec, preset, shape, hw, flops, threads if hw.kind == "cpu" else None)


def with_generation(
    spec: ModelSpec, preset: Preset, shape: TrainShape, hw: PlanHardware, pred: Any
) -> Any:
    """The time model's prediction ``pred`` (`homelab_dp.planning.time_model.Prediction`) of a
    GRPO option with its generation added: ``step_seconds`` includes it, ``tokens_per_s``
    and the speedup over one device follow (one device would generate every rank's
    prompts), and ``generation_seconds``, ``generation_share``, ``generation_engine`` and
    ``generated_tokens_per_s`` say it."""
    t = _time_of(spec, preset, shape, hw, pred)
    # With iterations = μ a batch is generated once and trained on μ steps: a step's mean share.
    gen = t.seconds / max(1, preset.grpo.iterations)
    step = pred.step_seconds + gen
    one_alone = (pred.tokens_per_step * pred.speedup_vs_one_device / pred.tokens_per_s
                 if pred.tokens_per_s else 0.0)  # fmt: skip
    one_alone += gen * shape.world_size
    speedup = one_alone / step if step else 0.0
    parts = {"compute": pred.compute_seconds, "communication": pred.exposed_comm_seconds,
             "offload": pred.offload_seconds, "generation": gen}  # fmt: skip
    assumptions = {**pred.assumptions, "decode_bandwidth": {
        "value": t.bandwidth, "source": "table" if hw.kind == "cuda" else "assumed",
        "words": t.bandwidth_source}, "decode_layer_seconds": {
        "value": t.layer_seconds, "source": "measured" if hw.kind == "cpu" else "assumed",
        "words": "fixed cost of one layer of an eager decode step"}}  # fmt: skip
    return replace(pred, step_seconds=step,
                   tokens_per_s=pred.tokens_per_step / step if step else 0.0,
                   speedup_vs_one_device=speedup, scaling_efficiency=speedup / shape.world_size,
                   bottleneck=max(parts, key=lambda k: parts[k]), assumptions=assumptions,
                   generation_seconds=gen,
                   generation_share=gen / step if step else 0.0,
                   generation_engine=engine_of(preset),
                   generation_decode_step_seconds=t.seconds_per_decode_step,
                   generated_tokens_per_s=(t.generated_tokens * shape.world_size / t.seconds
                                           if t.seconds else 0.0))  # fmt: skip


def generation_words(spec: ModelSpec, preset: Preset, shape: TrainShape, hw: PlanHardware,
                     pred: Any) -> str:  # fmt: skip
    """The speed advice's sentence on generation: its share of a step, the engine, and what
    bounds it."""
    t = _time_of(spec, preset, shape, hw, pred)
    gens = preset.grpo.generations
    bound = (t.weight_bytes + t.kv_bytes) / t.bandwidth
    why = ("memory bandwidth" if bound > t.layer_seconds * spec.layers
           else "the per-layer cost of an eager decode step (the model is small)")  # fmt: skip
    return (f"GRPO generation ≈ {pred.generation_seconds:.3g} s of each {pred.step_seconds:.3g} s "
            f"step ({pred.generation_share:.0%}), by {engine_of(preset)} (the project's batched "
            f"KV-cache decoder over transformers' forward; vLLM is not used): {t.groups} "
            f"group(s) of {gens} a rank × up to {preset.grpo.max_completion_tokens} tokens, "
            f"each decode step reading {format_bytes(int(t.weight_bytes))} of weights and "
            f"{format_bytes(int(t.kv_bytes))} of KV cache at {t.bandwidth_source}, bound by "
            f"{why}; ≈ {pred.generated_tokens_per_s:,.0f} tokens generated a second, every "
            "rank together, at full length.")  # fmt: skip


def memory_reason(spec: ModelSpec, preset: Preset, shape: TrainShape, b: Budget) -> str:
    """The plan's reason on GRPO's memory in the chosen option."""
    g = preset.grpo
    m = grpo_memory(spec, preset, shape)
    out = (f"GRPO: each rank generates its prompts' completions with {m.engine} (the weights "
           f"being trained{', adapters on' if shape.method != 'full' else ''}), one prompt's "
           f"{g.generations} at a time: a KV cache of {g.generations} × ({preset.data.seq_len} "
           f"+ {g.max_completion_tokens}) tokens = {m.kv_cache_bytes / 2**20:,.0f} MiB and the "
           f"prompt's forward {format_bytes(m.prompt_forward_bytes)}, freed before the "
           f"training forward: generation peaks at {format_bytes(m.generate_phase_bytes)} "
           "of tensors")  # fmt: skip
    out += (" (the step's peak)" if b.peak_phase == "generate"
            else f", under the training's {format_bytes(b.tensors)}")  # fmt: skip
    if m.reference_bytes:
        out += (f"; the reference forward (beta = {g.beta}) adds "
                f"{format_bytes(m.reference_bytes)} after the policy's")  # fmt: skip
    if m.old_logps_bytes:
        out += (f"; the old policy's log-probabilities (iterations = {g.iterations}) "
                f"{format_bytes(m.old_logps_bytes)}")  # fmt: skip
    return out + "; decoding is bound by memory bandwidth (every new token reads the weights once)."


Evaluate = Callable[..., Any]
"""`homelab_dp.planning.planner.evaluate` (passed in: the planner imports this module)."""


def halvings(value: int, least: int) -> list[int]:
    """``value`` halved again and again while at least ``least``: 8, 2 → [4, 2]."""
    out = []
    while value // 2 >= least:
        value //= 2
        out.append(value)
    return out


def knob_advice(spec: ModelSpec, preset: Preset, hw: PlanHardware, best: Any,
                evaluate: Evaluate, limit: float, calibration: Any = None) -> list[str]:  # fmt: skip
    """What helps a GRPO plan that does not fit, each knob planned (the distribution of the
    option that did best, checkpointing on when allowed, nothing offloaded): fewer generations and shorter
    completions (halved until the plan fits, at least 2 generations and 16 tokens), QLoRA
    (for a 16-bit base); those that fit first, the smallest total first."""
    g = preset.grpo
    ckpt = preset.train.activation_checkpointing in ("auto", True)

    def planned(variant: Preset, method: str) -> Any:
        return evaluate(spec, variant, hw, method, best.distribution, ckpt, calibration)

    knobs: list[tuple[str, Any]] = []
    for field, least in (("generations", 2), ("max_completion_tokens", 16)):
        c = None
        for value in halvings(getattr(g, field), least):
            c = planned(replace(preset, grpo=replace(g, **{field: value})), best.method)
            if c.fits:
                break
        if c is not None:
            knobs.append((f"grpo.{field} = {value}", c))
    if best.method != "qlora":
        qlora = replace(preset, train=replace(preset.train, method="qlora"))
        knobs.append(("train.method = 'qlora'", planned(qlora, "qlora")))
    out = []
    for words, c in sorted(knobs, key=lambda k: (not k[1].fits, k[1].budget.total)):
        verdict = "fits" if c.fits else "still too large, the least this knob alone gives"
        out.append(f"GRPO: {words} plans at {format_bytes(c.budget.total)} a device "
                   f"({c.budget.peak_phase} peak; {format_bytes(int(limit))} usable): "
                   f"{verdict}.")  # fmt: skip
    return out
