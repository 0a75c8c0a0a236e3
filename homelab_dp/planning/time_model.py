"""The time model: one optimizer step's seconds, tokens/s and multi-device scaling, per option
(pure arithmetic: no torch).

A step is compute + the communication it cannot hide + offload copies:

- **compute**: model FLOPs per token (`homelab_dp.planning.flops`, active parameters for MoE) ×
  the tokens one device trains per step ÷ the device's achieved FLOP/s: on CUDA its dense
  16-bit peak × an achieved-MFU factor, on the CPU the FLOP/s a thread achieves × the threads
  a process gets (`cpu_threads`, as the launcher sets OMP_NUM_THREADS). Both from
  `homelab_dp.planning.speed_calibration` (a stated default until this machine measured runs).
  Mixed cards: the slowest sets the pace (every rank waits for it at each collective);
- **communication**: the bytes each device sends per optimizer step (`comm_parts`: the 2(N−1)/N
  ring factor included) ÷ the slowest hop of the ring (`homelab_dp.planning.links`), plus a
  latency per collective;
- **overlap** (what is exposed): DDP's buckets all-reduce while backward still runs, except the
  last bucket (which holds the input embeddings' gradient: `last_bucket_bytes`); FSDP2 prefetches the next layer's all-gather while the current layer computes,
  except the first of each pass, and its reduce-scatters overlap backward except the last
  layer's; ZeRO-1's all-gather of the updated parameters after the optimizer step and offload
  copies overlap nothing. Without P2P (NCCL staging every chunk through host memory) nothing
  overlaps: the published two-card runs of docs/planning.md lose more time than the whole
  all-reduce would take at the link's rate, so the link's figure there is an effective one,
  fitted with overlap taken as none. Gradients are synchronised once per optimizer step (no_sync during
  accumulation), so raising ``grad_accum`` divides DDP's exposed communication per token. On
  the CPU nothing overlaps: gloo's collectives run on the cores the compute uses;
- **offload**: the PCIe seconds of `homelab_dp.planning.memory.offload_cost`, not overlapped.

``speedup_vs_one_device`` compares with one device of the same kind training the same
micro-batches with no communication (the fastest planned card; on the CPU one process with
every thread), whether or not that fits its memory; ``scaling_efficiency`` is it ÷ devices.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from homelab_dp.planning.flops import (
    adapter_params_per_token,
    attention_forward_flops,
    causal_span,
    flops_per_token,
    linear_matmul_params,
    peak_flops,
)
from homelab_dp.planning.links import NO_LINK, LinkSpeed
from homelab_dp.planning.memory.device_memory import comm_bytes_per_step
from homelab_dp.planning.memory.mlp_tiles import mlp_forward_flops_per_token
from homelab_dp.planning.memory.train_shape import (
    TrainShape,
    compute_width,
    lora_targets_of,
    trainable_params,
)
from homelab_dp.planning.model_spec import ModelSpec
from homelab_dp.planning.objective_cost import sequence_len, shape_flops_factor
from homelab_dp.planning.plan_hardware import PlanHardware
from homelab_dp.planning.sequence_split import all_to_all_bytes
from homelab_dp.planning.speed_calibration import ComputeRate

DDP_BUCKET_BYTES = 25 * 2**20
"""DDP's bucket size on CUDA (``bucket_cap_mb`` 25): the last bucket's all-reduce is exposed."""


def ddp_bucket_cap(device_kind: str, grad_bytes: float) -> float:
    """DDP's bucket size, one rule for the worker (`homelab_dp.train.parallelism.strategy`)
    and this model: 25 MiB on CUDA, where NCCL all-reduces a bucket on its own stream while
    backward goes on; on the CPU one bucket for every gradient, so one all-reduce after
    backward. gloo's threads run on the cores backward computes on, so a bucket sent early
    hides nothing and only interrupts the compute: one bucket measured 2.2–2.6% more
    tokens/s than 25 MiB buckets (`benchmarks/vs_hf_trainer.py --trees`, 2 processes)."""
    if device_kind == "cuda":
        return float(DDP_BUCKET_BYTES)
    return float(max(DDP_BUCKET_BYTES, math.ceil(grad_bytes / 2**20 + 1) * 2**20))


UNKNOWN_PEAK_FLOPS = 71e12
"""A card the peak table does not know (a what-if card) is priced as an RTX 3090 (71 TFLOPS
dense bf16 with fp32 accumulate), and the assumption says so."""
GOOD_EFFICIENCY = 0.8
"""Below this scaling efficiency the advice names what costs the time."""


def cpu_threads(world_size: int) -> int:
    """Threads one CPU process computes with: OMP_NUM_THREADS when set, else the cores shared
    out (`homelab_dp.supervise.launcher` sets the same)."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env)
    return max(1, (os.cpu_count() or 1) // max(1, world_size))


@dataclass(frozen=True)
class CommPart:
    """One collective of a step: bytes each device sends per optimizer step, and its overlap."""

    name: str
    """"all-reduce", "all-gather (forward)", "all-gather (backward)", "reduce-scatter",
    "all-gather (after the step)"."""
    bytes_per_step: float
    per_micro_step: bool
    """Issued every micro-step (FSDP's gathers) rather than once per optimizer step."""
    overlaps: str
    """"forward", "backward" or "none": the compute it hides behind."""
    exposed_share: float
    """The share that never overlaps (the last bucket, the first layer's gather)."""
    collectives: int
    """Collectives per issue (buckets, layers): each costs the link's latency."""


def comm_parts(spec: ModelSpec, shape: TrainShape, device_kind: str = "cuda") -> list[CommPart]:
    """What one device sends per optimizer step, by collective (ring factor included);
    ``device_kind`` sets DDP's buckets (`ddp_bucket_cap`).

    The same bytes as `homelab_dp.planning.memory.device_memory.comm_bytes_per_step`, split so
    that each can be overlapped its own way, with one addition: LoRA under FSDP also gathers
    its frozen, sharded base every micro-step (FSDP2 shards every parameter).
    """
    n = shape.world_size
    if n <= 1:
        return []
    ring = (n - 1) / n
    grads = trainable_params(spec, shape) * 4.0
    layers = max(1, spec.layers)
    split = _sequence_exchange(spec, shape)
    if shape.distribution in ("ddp", "zero1"):
        bucket = ddp_bucket_cap(device_kind, grads)
        buckets = max(1, math.ceil(grads / bucket))
        out = [CommPart("all-reduce", 2 * ring * grads, False, "backward",
                        last_bucket_bytes(spec, shape, bucket) / grads, buckets)]  # fmt: skip
        if shape.distribution == "zero1":
            out.append(CommPart("all-gather (after the step)", ring * spec.params * 4.0, False,
                                "none", 1.0, 1))  # fmt: skip
        return out + split
    passes = (2 if shape.distribution == "fsdp-full" else 1) * shape.grad_accum
    if shape.method == "qlora":
        # the memory model's bytes: packed 4-bit weights, the 16-bit rest and the adapters
        gather = (comm_bytes_per_step(spec, shape) - ring * grads) / passes
    else:
        gather = ring * spec.params * compute_width(shape)
    gather *= shape.grad_accum  # every micro-step gathers again
    out = [CommPart("all-gather (forward)", gather, True, "forward", 1 / layers, layers)]
    if shape.distribution == "fsdp-full":
        out.append(CommPart("all-gather (backward)", gather, True, "backward", 1 / layers, layers))
    out.append(CommPart("reduce-scatter", ring * grads, False, "backward", 1 / layers, layers))
    return out + split


def _sequence_exchange(spec: ModelSpec, shape: TrainShape) -> list[CommPart]:
    """Sequence parallelism's all-to-alls (`homelab_dp.planning.sequence_split`): every
    micro-step, on the compute stream (nothing hides them), four per attention layer and pass."""
    degree = shape.sequence_parallel
    if degree <= 1:
        return []
    per_micro = all_to_all_bytes(spec, degree=degree, micro_batch=shape.micro_batch,
                                 local_len=shape.seq_len, width=compute_width(shape),
                                 checkpointing=shape.activation_checkpointing)  # fmt: skip
    passes = 3 if shape.activation_checkpointing else 2
    return [CommPart("all-to-all (sequence)", per_micro * shape.grad_accum, True, "none", 1.0,
                     4 * passes * max(1, spec.layers))]  # fmt: skip


def last_bucket_bytes(
    spec: ModelSpec, shape: TrainShape, bucket: float = DDP_BUCKET_BYTES
) -> float:
    """Gradient bytes of DDP's last bucket, whose all-reduce starts only when backward ends.

    DDP fills its buckets in reverse parameter order, so the input embeddings (the first
    parameters, their gradient the last one backward writes) are in the last bucket; a
    parameter larger than ``bucket_cap_mb`` is a bucket of its own. A full fine-tune's last
    bucket is therefore the larger of a bucket and the embeddings (GPT-2 124M: 31% of its
    gradients); LoRA trains no embedding."""
    grads = trainable_params(spec, shape) * 4.0
    last = float(bucket)
    if shape.method == "full":
        last = max(last, spec.embedding_params * 4.0)
    return min(grads, last)


def forward_flops_per_token(spec: ModelSpec, shape: TrainShape) -> float:
    """The forward pass's share of a token's FLOPs (what forward communication hides behind)."""
    fwd = 2.0 * linear_matmul_params(spec) + attention_forward_flops(
        spec,
        causal_span(shape.seq_len * shape.sequence_parallel),  # a split: the whole span
    )
    if shape.method != "full":
        fwd += 2.0 * adapter_params_per_token(spec, shape.lora_r, lora_targets_of(shape))
    return fwd


def step_flops_per_token(spec: ModelSpec, shape: TrainShape) -> float:
    """Model FLOPs per trained token of ``shape`` (forward, backward, recomputation), times
    what its objective adds (a preference objective's reference and KL forwards:
    `homelab_dp.planning.objective_cost.shape_flops_factor`); a packed preference row's
    attention spans one sequence of it, not the row."""
    per_token = flops_per_token(
        spec,
        method=shape.method,
        activation_checkpointing=shape.activation_checkpointing,
        attention_span=causal_span(sequence_len(shape)),
        lora_r=shape.lora_r,
        lora_targets=lora_targets_of(shape),
    )
    per_token += mlp_forward_flops_per_token(spec, shape)  # a tiled MLP's recompute
    if shape.objective == "sft":
        return per_token
    return per_token * shape_flops_factor(spec, shape)


@dataclass(frozen=True)
class DeviceRate:
    """One device's achieved compute, with what it rests on."""

    flops_per_s: float
    peak: float | None
    """CUDA: its dense 16-bit peak (`UNKNOWN_PEAK_FLOPS` for an unknown card); None on the CPU."""
    peak_known: bool
    threads: int | None


def device_rates(hw: PlanHardware, rate: ComputeRate, world_size: int) -> list[DeviceRate]:
    """Every planned device's achieved FLOP/s at ``rate`` (processes sharing the CPU as
    ``world_size`` of them would)."""
    if hw.kind == "cpu":
        threads = cpu_threads(world_size)
        flops = rate.cpu_process_flops(threads)
        return [DeviceRate(flops, None, False, threads) for _ in hw.devices]
    out = []
    for d in hw.devices:
        peak = peak_flops(d.name)
        out.append(DeviceRate((peak or UNKNOWN_PEAK_FLOPS) * (rate.factor or 0.0),
                              peak or UNKNOWN_PEAK_FLOPS, peak is not None, None))  # fmt: skip
    return out


@dataclass(frozen=True)
class Prediction:
    """The ``predicted`` block of a candidate in `plan --json` (one optimizer step)."""

    step_seconds: float
    compute_seconds: float
    """The slowest device's compute of the step (every micro-step)."""
    comm_seconds: float
    """Every collective's time on the link, hidden or not."""
    exposed_comm_seconds: float
    """The part compute does not hide."""
    offload_seconds: float
    tokens_per_s: float
    """Every device together (tokens of the full blocks: micro × seq_len each)."""
    speedup_vs_one_device: float
    scaling_efficiency: float
    bottleneck: str
    """"compute", "communication" or "offload": what takes most of the step. ("input" — data
    loading — is not modelled: packed blocks are prepared before the run.)"""
    flops_per_token: float
    tokens_per_step: int
    """Tokens of one optimizer step, every device together."""
    comm_bytes_per_step: int
    """Bytes each device sends per optimizer step, as priced here."""
    pace_device: str
    """The device that sets the pace (the slowest)."""
    straggler_wait: float
    """The share of each step the fastest device waits for the slowest (0: matched devices)."""
    assumptions: dict[str, Any] = field(default_factory=dict)
    """peak_flops, achieved_factor (CUDA) or achieved_flops_per_s (CPU), link: each with its
    value and "source" (table | measured | calibrated | given), and threads_per_process on
    the CPU."""
    generation_seconds: float = 0.0
    """GRPO: one rank's generation in the step, within ``step_seconds``
    (`homelab_dp.planning.grpo_plan.with_generation`); 0 for other objectives."""
    generation_share: float = 0.0
    """GRPO: generation's share of ``step_seconds`` (0..1)."""
    generation_engine: str | None = None
    """GRPO: what generates ("transformers"); None for other objectives."""
    generated_tokens_per_s: float = 0.0
    """GRPO: tokens generated a second while generating, every rank together, at full length."""
    generation_decode_step_seconds: float = 0.0
    """GRPO: one decode step of a group (all its rows), the prompt's forward left out."""

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _exposed(t: float, share: float, hide: float) -> float:
    """What of ``t`` seconds of communication shows when ``hide`` seconds of compute run beside
    it and ``share`` of it can never overlap."""
    fixed = t * share
    return fixed + max(0.0, t - fixed - hide)


def predict(
    spec: ModelSpec,
    shape: TrainShape,
    hw: PlanHardware,
    *,
    link: LinkSpeed = NO_LINK,
    rate: ComputeRate,
    offload_seconds: float = 0.0,
) -> Prediction:
    """The time model's answer for one option ``shape`` of ``spec`` on ``hw``.

    ``link``: the slowest hop of the ring (`homelab_dp.planning.links.ring_link`,
    ``gloo_link`` on the CPU, ``parse_network`` across machines); ``rate``: the achieved
    compute (`homelab_dp.planning.speed_calibration.SpeedStore.rate_for`); ``offload_seconds``:
    the offload's PCIe seconds per step (`homelab_dp.planning.memory.offload_cost`). The bytes come from
    `comm_parts`, collective by collective.
    """
    per_token = step_flops_per_token(spec, shape)
    fwd_share = min(1.0, forward_flops_per_token(spec, shape) / per_token) if per_token else 0.0
    micro_tokens = shape.micro_batch * shape.seq_len
    rates = device_rates(hw, rate, shape.world_size)
    slow = min(rates, key=lambda r: r.flops_per_s)
    fast = max(rates, key=lambda r: r.flops_per_s)
    micro_compute = per_token * micro_tokens / slow.flops_per_s if slow.flops_per_s else math.inf
    compute = micro_compute * shape.grad_accum
    c_fwd, c_bwd = micro_compute * fwd_share, micro_compute * (1 - fwd_share)
    parts = comm_parts(spec, shape, hw.kind)
    comm = exposed = 0.0
    # gloo on the CPU shares the cores the compute uses; without P2P, NCCL's copies through
    # host memory hide behind nothing either (fitted on published runs: docs/planning.md).
    overlap = hw.kind == "cuda" and link.kind != "host-bounce"
    # One micro-step's communication (FSDP's gathers), then what only the last one sends.
    for last in (False, True):
        hide = {"forward": c_fwd if overlap else 0.0, "backward": c_bwd if overlap else 0.0,
                "none": 0.0}  # fmt: skip
        issues = 1 if last else shape.grad_accum - 1
        if issues <= 0:
            continue
        by_phase: dict[str, tuple[float, float]] = {}
        for p in parts:
            if not p.per_micro_step and not last:
                continue
            bytes_ = p.bytes_per_step / (shape.grad_accum if p.per_micro_step else 1)
            t = (
                bytes_ / link.bytes_per_s if link.bytes_per_s else 0.0
            ) + p.collectives * link.latency_s
            fixed, total = by_phase.get(p.overlaps, (0.0, 0.0))
            by_phase[p.overlaps] = (fixed + t * p.exposed_share, total + t)
        for phase, (fixed, total) in by_phase.items():
            share = fixed / total if total else 0.0
            comm += issues * total
            exposed += issues * _exposed(total, share, hide[phase])
    step = compute + exposed + offload_seconds
    tokens_step = micro_tokens * shape.grad_accum * shape.world_size
    tokens_per_s = tokens_step / step if step and math.isfinite(step) else 0.0
    # One device alone: the fastest planned card (on the CPU one process with every thread).
    alone = device_rates(hw, rate, 1)
    best_alone = max(r.flops_per_s for r in alone)
    one_tps = best_alone / per_token if per_token else 0.0
    one_tps_with_offload = (
        micro_tokens * shape.grad_accum
        / (micro_tokens * shape.grad_accum / one_tps + offload_seconds)
        if one_tps else 0.0
    )  # fmt: skip
    speedup = tokens_per_s / one_tps_with_offload if one_tps_with_offload else 0.0
    parts_time = {"compute": compute, "communication": exposed, "offload": offload_seconds}
    bottleneck = max(parts_time, key=lambda k: parts_time[k])
    wait = 1 - fast_time_share(slow, fast) if len(rates) > 1 else 0.0
    assumptions = _assumptions(hw, rate, slow, link)
    return Prediction(
        step_seconds=step,
        compute_seconds=compute,
        comm_seconds=comm,
        exposed_comm_seconds=exposed,
        offload_seconds=offload_seconds,
        tokens_per_s=tokens_per_s,
        speedup_vs_one_device=speedup,
        scaling_efficiency=speedup / shape.world_size,
        bottleneck=bottleneck,
        flops_per_token=per_token,
        tokens_per_step=tokens_step,
        comm_bytes_per_step=int(sum(p.bytes_per_step for p in parts)),
        pace_device=hw.devices[rates.index(slow)].name,
        straggler_wait=wait,
        assumptions=assumptions,
    )


def fast_time_share(slow: DeviceRate, fast: DeviceRate) -> float:
    """The fastest device's compute time as a share of the slowest's (1: matched)."""
    return slow.flops_per_s / fast.flops_per_s if fast.flops_per_s else 1.0


def _assumptions(hw: PlanHardware, rate: ComputeRate, slow: DeviceRate,
                 link: LinkSpeed) -> dict[str, Any]:  # fmt: skip
    out: dict[str, Any] = {}
    if hw.kind == "cuda":
        out["peak_flops"] = {
            "value": slow.peak,
            "source": "table",
            "known": slow.peak_known,
            "words": "dense 16-bit peak of the card (NVIDIA's datasheet)" if slow.peak_known
            else "the card is not in the peak table: an RTX 3090's peak assumed",
        }  # fmt: skip
        out["achieved_factor"] = {"value": rate.factor, "source": rate.source, "words": rate.words}
    else:
        out["peak_flops"] = {"value": None, "source": "table",
                             "words": "a CPU's peak is not known: its achieved FLOP/s is used"}  # fmt: skip
        out["achieved_factor"] = {"value": None, "source": rate.source, "words": rate.words}
        out["threads_per_process"] = slow.threads
    out["achieved_flops_per_s"] = {"value": slow.flops_per_s, "source": rate.source,
                                   "words": "model FLOP/s of the slowest device"}  # fmt: skip
    out["link"] = link.to_json()
    return out
