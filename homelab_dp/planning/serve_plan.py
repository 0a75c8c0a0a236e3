"""The serving plan: what one replica of a model holds, and how many fit on each device (pure).

Replica parallelism is data parallelism for serving: every replica is a full copy of the model
answering different requests. It multiplies throughput by the number of cards, but it cannot
help a model that does not fit one card. Per replica (one process):

* ``weights``: parameters × bytes of the serving dtype (bf16/fp16 on CUDA: 2, fp32: 4), plus an
  adapter's own weights when a PEFT adapter is served beside its base.
* ``kv_cache``: 2 (keys and values) × layers × KV heads × head_dim × context × concurrent
  sequences × bytes, in the serving dtype: the cache of ``concurrent`` sequences of ``context``
  tokens each.
* ``activations``: the largest transient of a step. Prefill runs one prompt of ``context`` tokens
  through one layer at a time (no gradients, so a layer's tensors are freed before the next
  starts): context × (2·hidden [residual, normed input] + (heads + 2·KV heads)·head_dim [q, k, v]
  + heads·head_dim [attention output] + 3·intermediate [gate, up, their product]) × bytes. The
  loss head is computed for each sequence's last position only: 2 × concurrent × vocab × 4
  (fp32 logits and the sampler's probabilities).
* ``overhead``: what is not a tensor, as the training model assumes it (`planning.memory.device_memory`): the CUDA
  context (no NCCL: replicas never talk to each other) or the CPU's Python/torch runtime, plus
  the allocator's fragmentation as a fraction of the tensors.

``copies_fit`` per device is floor(memory / per-replica bytes); `serve` starts one replica per
device that holds a copy (copies on one card share its compute).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from homelab_dp.byte_units import format_bytes
from homelab_dp.planning.memory.device_memory import (
    CPU_FRAGMENTATION,
    CPU_RUNTIME_BYTES,
    CUDA_CONTEXT_BYTES,
    CUDA_FRAGMENTATION,
)
from homelab_dp.planning.model_spec import ATTENTION_KINDS, Mixer, ModelSpec
from homelab_dp.planning.plan_reasons import count

ServeKind = Literal["cuda", "cpu"]

DEFAULT_CONTEXT = 4096
"""Context length planned when none is given (capped by the model's positions)."""
DEFAULT_CONCURRENT = 8
"""Concurrent sequences per replica planned when none is given."""
MIN_TEMPERATURE = 1e-5
"""The smallest temperature above 0 (0 is greedy): float32 logits / 1e-5 stay finite up to
|logit| ~ 3e33, while 1e-38 makes them inf and the probabilities NaN (vLLM's floor is 1e-5
too). What one request may ask of a replica is checked twice from these: at the front (no
torch) and in the replica, which may not import each other."""
SEED_RANGE = (-(2**63), 2**64 - 1)
"""The seeds ``torch.Generator.manual_seed`` takes (beyond them it raises)."""
MAX_STOP_CHARS = 256
"""The longest stop string (the decoder looks for each one's prefixes at every token)."""
PROMPT_CHARS_PER_TOKEN = 32
"""A prompt of more characters than this times the context cannot fit it (no tokenizer we know
has longer tokens): refused before tokenizing."""
PROMPT_BYTES_PER_TOKEN = 64
"""Likewise in UTF-8 bytes."""


def prompt_size_problem(texts: list[str], what: str, context: int) -> str | None:
    """Why ``texts`` (a prompt, or the contents of messages: ``what``) cannot fit ``context``
    tokens by their size alone, characters or UTF-8 bytes, before any tokenizer spends seconds
    on them; None when they may."""
    chars = sum(len(t) for t in texts)
    if chars > PROMPT_CHARS_PER_TOKEN * context:
        return (
            f"the {what} has {chars} characters: more than fit the model's context of "
            f"{context} tokens ({PROMPT_CHARS_PER_TOKEN * context} characters at most)"
        )
    size = sum(len(t.encode("utf-8")) for t in texts)
    if size > PROMPT_BYTES_PER_TOKEN * context:
        return (
            f"the {what} has {size} bytes: more than fit the model's context of {context} "
            f"tokens ({PROMPT_BYTES_PER_TOKEN * context} UTF-8 bytes at most)"
        )
    return None


def request_size_problem(
    prompt: str | None, messages: list[dict[str, str]] | None, context: int
) -> tuple[str, str] | None:
    """`prompt_size_problem` of a request's prompt or, without one, its messages' contents:
    (the problem, the field it is in: "prompt" or "messages"); None when it may fit. The
    serving front and the replica both check it."""
    if prompt is not None:
        texts, where = [prompt], "prompt"
    else:
        texts, where = [m["content"] for m in messages or []], "messages"
    problem = prompt_size_problem(texts, where, context)
    return None if problem is None else (problem, where)


LOGITS_BYTES = 4
"""Logits are fp32 whatever the weights' dtype (transformers upcasts them for sampling)."""

CANNOT_HELP = (
    "replicas cannot help a model that does not fit one card: quantize it (a 4-bit or 8-bit "
    "copy) or shard it across cards (tensor parallel, e.g. vLLM's --tensor-parallel-size)"
)


@dataclass(frozen=True)
class ServeDevice:
    """One device a replica could run on."""

    index: int
    """The GPU's NVML index (as `homelab-dp probe` numbers it), or the CPU process's number."""
    name: str
    """The device for people: "GPU 1 (NVIDIA GeForce RTX 3090)", "what-if 24.0 GiB",
    "cpu process 0"."""
    memory_bytes: int
    """Its memory: the card's, or a CPU process's share of the host RAM."""


@dataclass(frozen=True)
class ServeDeviceFit:
    """One device and what fits on it."""

    index: int
    """As `ServeDevice.index`."""
    name: str
    """As `ServeDevice.name`."""
    memory_bytes: int
    """The device's memory."""
    copies_fit: int
    """Whole replicas that fit: floor(memory / per-replica bytes)."""
    spare_sequences: int
    """Concurrent sequences (of ``context`` tokens) the memory left beside one replica could
    hold instead of another copy; 0 where no copy fits."""


@dataclass(frozen=True)
class ServePlan:
    """Per-replica memory and the replicas that fit, with the reasons in plain words."""

    kind: ServeKind
    """"cuda" (one replica per card) or "cpu" (processes sharing the host RAM)."""
    params: int
    """The model's parameters (the base's, for an adapter)."""
    bytes_per_param: float
    """Bytes of the serving dtype: 2 for bf16/fp16, 4 for fp32."""
    context: int
    """Tokens per sequence (prompt and answer) the KV cache is planned for."""
    concurrent: int
    """Sequences a replica serves at once (its batch)."""
    weights_bytes: int
    """Parameters × bytes per parameter, plus an adapter's weights."""
    kv_cache_bytes: int
    """2 × layers × KV heads × head_dim × context × concurrent × bytes per parameter."""
    kv_bytes_per_sequence: int
    """The KV cache of one sequence of ``context`` tokens."""
    prefill_bytes: int
    """One layer's live tensors while one ``context``-token prompt is prefilled."""
    logits_bytes: int
    """2 × concurrent × vocab × 4: last-position fp32 logits and sampling probabilities."""
    overhead_bytes: int
    """The CUDA context or CPU runtime, plus fragmentation on the tensors (assumed)."""
    devices: list[ServeDeviceFit] = field(default_factory=list)
    """Every device considered, in order, with the copies that fit on it."""
    reasons: list[str] = field(default_factory=list)
    """Why, in plain words: the breakdown, one replica per card, what does not fit and why."""
    max_concurrent: int = 0
    """The most concurrent sequences of ``context`` tokens one replica could serve on the
    largest device (0: not even one)."""

    @property
    def activation_bytes(self) -> int:
        """The step's transient tensors: the prefill's layer and the last-position logits."""
        return self.prefill_bytes + self.logits_bytes

    @property
    def per_replica_bytes(self) -> int:
        """Weights + KV cache + activations + overhead."""
        return (
            self.weights_bytes + self.kv_cache_bytes + self.activation_bytes + self.overhead_bytes
        )

    @property
    def replicas(self) -> int:
        """Devices on which one copy fits (what `--replicas auto` starts)."""
        return sum(1 for d in self.devices if d.copies_fit >= 1)

    @property
    def fits(self) -> bool:
        """Whether at least one device holds a copy."""
        return self.replicas > 0

    def to_json(self) -> dict:
        """The serving plan as `serve --plan --json` would print it."""
        return {
            "kind": self.kind,
            "params": self.params,
            "bytes_per_param": self.bytes_per_param,
            "context": self.context,
            "concurrent": self.concurrent,
            "per_replica_bytes": {
                "weights": self.weights_bytes,
                "kv_cache": self.kv_cache_bytes,
                "activations": self.activation_bytes,
                "overhead": self.overhead_bytes,
                "total": self.per_replica_bytes,
            },
            "kv_bytes_per_sequence": self.kv_bytes_per_sequence,
            "devices": [
                {
                    "index": d.index,
                    "name": d.name,
                    "memory_bytes": d.memory_bytes,
                    "copies_fit": d.copies_fit,
                    "spare_sequences": d.spare_sequences,
                }
                for d in self.devices
            ],
            "replicas": self.replicas,
            "fits": self.fits,
            "max_concurrent": self.max_concurrent,
            "reasons": list(self.reasons),
        }


def kv_cache_bytes(spec: ModelSpec, context: int, sequences: int, bytes_per_el: float) -> int:
    """Keys and values of every layer for ``sequences`` × ``context`` tokens; for a model of
    layer groups, of its attention layers (a sliding layer keeps at most its window; a layer
    that reuses another's keys and values none) plus each state layer's fixed-size state
    (`recurrent_state_elements`), per sequence whatever the context."""
    if not spec.blocks:
        return int(
            2 * spec.layers * spec.kv_heads * spec.head_dim * context * sequences * bytes_per_el
        )
    per_seq = 0.0
    for g in spec.blocks:
        for m in g.kind.mixers:
            if m.kind in ATTENTION_KINDS:
                window = m.dim("window")
                kept = min(context, window) if window else context
                per_seq += g.count * 2 * m.dim("kv_heads", 0) * m.dim("head_dim", 1) * kept
            else:
                per_seq += g.count * recurrent_state_elements(m)
    return int(per_seq * sequences * bytes_per_el)


def recurrent_state_elements(m: Mixer) -> int:
    """A state mixer's cache per sequence: Gated DeltaNet's d_k × d_v state per value head and
    its convolution window; Mamba-2's d_head × d_state per head and its convolution window; a
    short convolution's window."""
    conv = max(0, m.dim("conv_kernel", 4) - 1)
    if m.kind == "linear_attention":
        vh, dk, dv = m.dim("v_heads", 1), m.dim("k_dim", 1), m.dim("v_dim", 1)
        return vh * dk * dv + conv * (2 * m.dim("k_heads", 1) * dk + vh * dv)
    if m.kind in ("mamba2", "mamba"):
        heads, hd, n = m.dim("heads", 1), m.dim("head_dim", 1), m.dim("state", 16)
        inner = m.dim("inner", heads * hd)
        return heads * hd * n + conv * (inner + 2 * m.dim("groups", 1) * n)
    return conv * m.dim("width", 1)


def prefill_layer_bytes(spec: ModelSpec, tokens: int, bytes_per_el: float) -> int:
    """One decoder layer's live tensors while ``tokens`` prompt tokens pass through it."""
    attn, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    per_token = 2 * spec.hidden + attn + 2 * kv + attn + 3 * spec.intermediate
    return int(tokens * per_token * bytes_per_el)


def plan_serving(
    spec: ModelSpec,
    devices: list[ServeDevice],
    *,
    weight_bytes_per_param: float,
    context: int,
    concurrent: int,
    kind: ServeKind,
    adapter_bytes: int = 0,
) -> ServePlan:
    """Budget one replica of ``spec`` and count the copies that fit on each of ``devices``."""
    w = weight_bytes_per_param
    runtime = CUDA_CONTEXT_BYTES if kind == "cuda" else CPU_RUNTIME_BYTES
    frag = CUDA_FRAGMENTATION if kind == "cuda" else CPU_FRAGMENTATION
    weights = int(spec.params * w) + int(adapter_bytes)
    per_seq = kv_cache_bytes(spec, context, 1, w)
    seq_logits = 2 * spec.vocab * LOGITS_BYTES
    prefill = prefill_layer_bytes(spec, context, w)
    kv = per_seq * concurrent
    logits = seq_logits * concurrent
    tensors = weights + kv + prefill + logits
    overhead = int(runtime + frag * tensors)
    per_replica = tensors + overhead

    # Each further sequence costs its cache and logits, plus their share of fragmentation.
    seq_cost = (per_seq + seq_logits) * (1 + frag)
    fixed = runtime + (weights + prefill) * (1 + frag)
    fits: list[ServeDeviceFit] = []
    for d in devices:
        copies = d.memory_bytes // per_replica if per_replica > 0 else 0
        spare = int((d.memory_bytes - per_replica) // seq_cost) if copies >= 1 else 0
        fits.append(ServeDeviceFit(d.index, d.name, d.memory_bytes, int(copies), max(0, spare)))
    largest = max((d.memory_bytes for d in devices), default=0)
    max_conc = max(0, int((largest - fixed) // seq_cost)) if largest else 0

    plan = ServePlan(
        kind=kind, params=spec.params, bytes_per_param=w, context=context,
        concurrent=concurrent, weights_bytes=weights, kv_cache_bytes=kv,
        kv_bytes_per_sequence=per_seq, prefill_bytes=prefill, logits_bytes=logits,
        overhead_bytes=overhead, devices=fits, max_concurrent=max_conc,
    )  # fmt: skip
    plan.reasons.extend(serve_reasons(spec, plan, adapter_bytes))
    return plan


def serve_reasons(spec: ModelSpec, plan: ServePlan, adapter_bytes: int = 0) -> list[str]:
    """The plan in plain words: the breakdown, the rule of one replica per card, what fits."""
    dtype = {2: "16-bit", 4: "fp32"}.get(int(plan.bytes_per_param), f"{plan.bytes_per_param} B")
    adapter = f" + the adapter's {format_bytes(adapter_bytes)}" if adapter_bytes else ""
    out = [
        f"One replica holds the weights ({count(plan.params)} params in {dtype}: "
        f"{format_bytes(plan.weights_bytes)}{adapter}), the KV cache of {plan.concurrent} "
        f"concurrent sequences of {plan.context} tokens (2 × {spec.layers} layers × "
        f"{spec.kv_heads} KV heads × {spec.head_dim} × {plan.context} tokens × "
        f"{plan.concurrent} sequences × {plan.bytes_per_param:g} bytes = "
        f"{format_bytes(plan.kv_cache_bytes)}, {format_bytes(plan.kv_bytes_per_sequence)} a "
        f"sequence), a step's activations ({format_bytes(plan.activation_bytes)}) and the "
        f"overhead ({format_bytes(plan.overhead_bytes)}): "
        f"{format_bytes(plan.per_replica_bytes)} in all."
    ]
    if plan.kind == "cpu":
        n = len(plan.devices)
        share = "the host RAM" if n == 1 else f"an equal share of the host RAM ({n} processes)"
        out.append(f"On the CPU a replica is a process with {share}; replicas share the cores.")
    if not plan.fits:
        largest = max(plan.devices, key=lambda d: d.memory_bytes, default=None)
        where = f"{largest.name} ({format_bytes(largest.memory_bytes)})" if largest else "no device"
        one = "one card" if plan.kind == "cuda" else "one process's share of the host RAM"
        out.append(
            f"The model does not fit {one}: a replica needs "
            f"{format_bytes(plan.per_replica_bytes)}, the largest device is {where}."
        )
        if plan.kind == "cpu" and len(plan.devices) > 1:
            out.append("Fewer CPU processes give each a larger share (--gpus cpu:1).")
        if plan.max_concurrent >= 1:  # the weights fit: only the KV cache is too big
            out.append(
                f"The weights fit; the KV cache does not. With {plan.max_concurrent} concurrent "
                f"sequence(s) of {plan.context} tokens (instead of {plan.concurrent}), or a "
                "shorter context, one copy would fit (--concurrent, --context)."
            )
        else:
            out.append(CANNOT_HELP[0].upper() + CANNOT_HELP[1:] + ".")
        return [*out, _assumed(plan)]
    hold = [d for d in plan.devices if d.copies_fit >= 1]
    unit = "card" if plan.kind == "cuda" else "process"
    out.append(
        f"One copy fits on {len(hold)} of {len(plan.devices)} {unit}(s): --replicas auto "
        f"starts one replica on each ({len(hold)} in all)."
    )
    many = [d for d in hold if d.copies_fit > 1]
    best = max(hold, key=lambda d: d.spare_sequences)
    if plan.kind == "cuda" and many:
        d = max(many, key=lambda d: d.spare_sequences)
        out.append(
            f"{d.name} could hold {d.copies_fit} copies, but serve starts one replica per "
            f"card: copies on one card share its compute and do not add throughput. The "
            f"{format_bytes(d.memory_bytes - plan.per_replica_bytes)} left there could hold "
            f"{d.spare_sequences} more concurrent sequences of {plan.context} tokens instead."
        )
    elif plan.kind == "cuda":
        out.append(
            f"Serve starts one replica per card (copies on one card share its compute and do "
            f"not add throughput); the memory left on {best.name} could hold "
            f"{best.spare_sequences} more concurrent sequences of {plan.context} tokens."
        )
    else:
        out.append(
            f"The RAM left beside a replica in {best.name} could hold {best.spare_sequences} "
            f"more concurrent sequences of {plan.context} tokens."
        )
    short = [d for d in plan.devices if d.copies_fit < 1]
    if short:
        names = ", ".join(d.name for d in short)
        out.append(f"No copy fits on {names}: it gets no replica.")
    out.append(_assumed(plan))
    return out


def _assumed(plan: ServePlan) -> str:
    """Which terms are assumptions (the training model's overhead constants)."""
    if plan.kind == "cuda":
        return (
            f"Overhead assumed, not measured: CUDA context {CUDA_CONTEXT_BYTES >> 20} MiB and "
            f"{CUDA_FRAGMENTATION:.0%} fragmentation per replica."
        )
    return (
        f"Overhead assumed, not measured: Python/torch runtime {CPU_RUNTIME_BYTES >> 20} MiB "
        f"and {CPU_FRAGMENTATION:.0%} fragmentation per process."
    )
