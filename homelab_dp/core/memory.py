"""Per-device memory budget of one training configuration (pure arithmetic, no torch).

The budget is the tensor memory alive at the moment of the peak, split into components, plus
an overhead term for what is not a tensor (CUDA context, NCCL or gloo buffers, allocator
fragmentation, the Python runtime on CPU). References: ZeRO (Rajbhandari et al. 2020) §3.1/§5
for model states, Korthikanti et al. 2022 §4 for activations, QLoRA (Dettmers et al. 2023) §3.

How the numbers follow the implementation in `homelab_dp.train`:

* CPU runs are fp32 throughout. CUDA runs keep fp32 master weights and autocast to bf16/fp16;
  autocast's 16-bit weight copies stay referenced by the autograd graph until backward, so
  DDP/ZeRO-1 pay them as a buffer. FSDP2 all-gathers 16-bit parameters instead.
* Gradients are fp32. With gradient accumulation they live through the forward pass of every
  micro-step but the first; without it only the lm_head gradient exists when the peak (the
  start of backward) happens.
* Logits: the lm_head output, its log-softmax (saved for backward) and the gradient of the
  log-softmax, all b·s·V; on CUDA the 16-bit logits are upcast to fp32 first.
* QLoRA: decoder linears in NF4 with double quantization (0.5 + ~0.016 bytes/param);
  `prepare_model_for_kbit_training` upcasts everything else (embeddings, lm_head, norms) to
  fp32 — 4 bytes/param, often the largest weight term for big-vocabulary models.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Literal

from homelab_dp.core.model_spec import ModelSpec

GiB = 1024**3
MiB = 1024**2

NF4_BYTES_PER_PARAM = 0.5 + 1 / 64 + 4 / (64 * 256)
"""NF4 weights with double quantization: 4 bits, an 8-bit absmax per 64-block, fp32 per 256 blocks."""

# Assumed, not measured (stated as such in every plan): see `overhead_terms`.
CUDA_CONTEXT_BYTES = 512 * MiB
NCCL_BUFFER_BYTES = 256 * MiB
CUDA_FRAGMENTATION = 0.10
CPU_RUNTIME_BYTES = 700 * MiB
CPU_FRAGMENTATION = 0.05

COMPONENTS = ("weights", "gradients", "optimizer", "activations", "logits", "buffers")


@dataclass(frozen=True)
class TrainShape:
    """One configuration to budget: method, distribution and batch geometry."""

    method: Literal["full", "lora", "qlora"]
    distribution: Literal["ddp", "zero1", "fsdp-grad-op", "fsdp-full"]
    world_size: int
    device: Literal["cuda", "cpu"]
    dtype: Literal["fp32", "bf16", "fp16"]
    micro_batch: int
    seq_len: int
    grad_accum: int = 1
    activation_checkpointing: bool = False
    optimizer: Literal["adamw", "adamw8bit", "sgd"] = "adamw"
    lora_r: int = 16
    lora_targets: str | tuple[str, ...] = "all-linear"


@dataclass(frozen=True)
class Budget:
    """Bytes per device at the peak, by component."""

    weights: int
    gradients: int
    optimizer: int
    activations: int
    logits: int
    buffers: int
    overhead: int
    peak_phase: str
    """When the peak happens: "backward" (start of backward) or "optimizer step"."""
    comm_bytes_per_step: int
    trainable_params: int

    @property
    def tensors(self) -> int:
        """Predicted peak of live tensor bytes (everything but the overhead)."""
        return sum(getattr(self, c) for c in COMPONENTS)

    @property
    def total(self) -> int:
        return self.tensors + self.overhead

    def per_device_bytes(self) -> dict[str, int]:
        """The `per_device_bytes` block of `plan --json`."""
        out = {c: int(getattr(self, c)) for c in COMPONENTS}
        out["overhead"] = int(self.overhead)
        out["total"] = int(self.total)
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def _compute_bytes(shape: TrainShape) -> int:
    """Bytes per element of activations and gathered weights."""
    return 4 if shape.dtype == "fp32" else 2


def activation_elements_per_token(spec: ModelSpec) -> int:
    """Elements saved for backward per token by one decoder layer (SDPA attention, no s² term).

    LLaMA-style layer: the layer input, two norm outputs, q and k after RoPE, v, the attention
    output and its re-laid-out copy for o_proj, the mid-layer residual (≈ 7h + 2·kv·head_dim),
    and four intermediate-sized MLP tensors (gate, SiLU(gate), up, their product).
    """
    h, kvd = spec.hidden, spec.kv_heads * spec.head_dim
    attn = spec.heads * spec.head_dim
    if spec.model_type == "gpt2":
        # ln_1/ln_2 outputs, fused qkv, attention out and merge copy, residuals; fc and GELU.
        return 6 * h + 3 * h + 3 * spec.intermediate
    return 4 * h + 3 * attn + 2 * kvd + 4 * spec.intermediate


def activation_bytes(spec: ModelSpec, shape: TrainShape) -> int:
    """Activations saved for backward on one device (logits excluded)."""
    tokens = shape.micro_batch * shape.seq_len
    width = _compute_bytes(shape)
    per_layer = activation_elements_per_token(spec) * tokens * width
    if shape.dtype != "fp32":
        # HF RMSNorm/LayerNorm upcast to fp32 and keep the fp32 input and normed copy (2 norms).
        per_layer += 2 * 2 * spec.hidden * tokens * 4
    # Embedding output, final norm input and output.
    outer = 3 * spec.hidden * tokens * width
    if shape.activation_checkpointing:
        # Each layer keeps only its input; one layer is recomputed in full during backward.
        return spec.layers * spec.hidden * tokens * width + per_layer + outer
    return spec.layers * per_layer + outer


def logits_bytes(spec: ModelSpec, shape: TrainShape) -> int:
    """Logits, their log-softmax and its gradient at the start of backward."""
    elements = shape.micro_batch * shape.seq_len * spec.vocab
    per_element = 12 if shape.dtype == "fp32" else 2 + 4 + 4 + 4
    return elements * per_element


def trainable_params(spec: ModelSpec, shape: TrainShape) -> int:
    """Parameters that receive gradients."""
    if shape.method == "full":
        return spec.params
    targets = (
        shape.lora_targets if isinstance(shape.lora_targets, str) else list(shape.lora_targets)
    )
    return spec.lora_params(shape.lora_r, targets)


def _optimizer_bytes_per_param(shape: TrainShape) -> float:
    return {"adamw": 8.0, "adamw8bit": 2.0, "sgd": 0.0}[shape.optimizer]


def comm_bytes_per_step(spec: ModelSpec, shape: TrainShape) -> int:
    """Bytes each device sends per optimizer step (ring collectives).

    DDP and ZeRO-1 all-reduce fp32 gradients once per step: 2(N-1)/N × gradient bytes; ZeRO-1
    also broadcasts the updated parameter shards. FSDP all-gathers 16-bit (fp32 on CPU)
    parameters every micro-step (grad-op once, full twice: forward and backward) and
    reduce-scatters gradients once. LoRA moves only the adapters' gradients.
    """
    n = shape.world_size
    if n <= 1:
        return 0
    ring = (n - 1) / n
    grad_bytes = trainable_params(spec, shape) * 4
    if shape.method != "full":
        return int(2 * ring * grad_bytes)
    gather = spec.params * _compute_bytes(shape)
    if shape.distribution == "ddp":
        return int(2 * ring * grad_bytes)
    if shape.distribution == "zero1":
        return int(2 * ring * grad_bytes + ring * spec.params * 4)
    gathers = 1 if shape.distribution == "fsdp-grad-op" else 2
    return int(ring * (gathers * shape.grad_accum * gather + grad_bytes))


def budget(spec: ModelSpec, shape: TrainShape) -> Budget:
    """The per-device memory budget of ``shape`` for the model ``spec``."""
    n = shape.world_size
    width = _compute_bytes(shape)
    mixed = shape.device == "cuda" and shape.dtype != "fp32"
    trainable = trainable_params(spec, shape)
    opt_per_param = _optimizer_bytes_per_param(shape)
    sharded = shape.distribution in ("fsdp-grad-op", "fsdp-full")

    buffers = 0
    if shape.method == "full":
        master = spec.params * 4  # fp32 master weights
        if sharded:
            weights = master / n
            if shape.distribution == "fsdp-grad-op":
                # Unsharded (16-bit on CUDA) parameters kept from forward through backward.
                buffers += spec.params * width
            else:
                # The root unit (embeddings, final norm, lm_head) stays gathered after forward,
                # plus the current and the prefetched decoder layer.
                root = spec.embedding_params + spec.lm_head_params + spec.final_norm_params
                buffers += (root + 2 * spec.layer_params) * width
        else:
            weights = master
            if mixed:
                buffers += spec.params * width  # autocast's 16-bit weight copies
        grads_full = trainable * 4 / (n if sharded else 1)
        opt_full = trainable * opt_per_param / (n if shape.distribution != "ddp" else 1)
    else:
        # LoRA/QLoRA: a frozen base plus fp32 adapters with their own grads and optimizer state.
        base_width = width if shape.device == "cuda" else 4
        if shape.method == "qlora":
            other = spec.params - spec.quantizable_params
            base = spec.quantizable_params * NF4_BYTES_PER_PARAM + other * 4
            # One linear dequantized at a time for the matmul.
            largest = max(lin.d_in * lin.d_out for lin in spec.linears)
            buffers += 2 * largest * base_width
        else:
            base = spec.params * base_width
            if sharded:
                base = base / n + (2 * spec.layer_params) * base_width
        weights = base + trainable * 4
        grads_full = trainable * 4
        opt_full = trainable * opt_per_param

    activations = activation_bytes(spec, shape)
    logits = logits_bytes(spec, shape)
    lm_head_grad = (
        (spec.lm_head_params or spec.embedding_params) * 4 if shape.method == "full" else 0
    )
    if shape.method == "full" and sharded:
        lm_head_grad = lm_head_grad / n

    # Peak candidate 1: start of backward. Accumulated gradients are alive from the second
    # micro-step on; otherwise only the lm_head gradient has been produced yet.
    grads_at_backward = grads_full if shape.grad_accum > 1 else min(lm_head_grad, grads_full)
    backward_peak = weights + buffers + opt_full + grads_at_backward + activations + logits
    # Peak candidate 2: the optimizer step (fused AdamW: no per-parameter temporaries).
    # FSDP frees the gathered parameters after backward, so buffers do not count here.
    step_peak = weights + grads_full + opt_full
    if backward_peak >= step_peak:
        phase = "backward"
        grads, acts, lgts, bufs = grads_at_backward, activations, logits, buffers
    else:
        phase = "optimizer step"
        grads, acts, lgts, bufs = grads_full, 0, 0, 0
    tensors = weights + grads + opt_full + acts + lgts + bufs
    return Budget(
        weights=int(weights),
        gradients=int(grads),
        optimizer=int(opt_full),
        activations=int(acts),
        logits=int(lgts),
        buffers=int(bufs),
        overhead=int(overhead_bytes(tensors, shape)),
        peak_phase=phase,
        comm_bytes_per_step=comm_bytes_per_step(spec, shape),
        trainable_params=int(trainable),
    )


def overhead_bytes(tensor_bytes: float, shape: TrainShape) -> float:
    """Memory that is not a tensor: runtime, communication buffers, allocator fragmentation."""
    if shape.device == "cuda":
        comm = NCCL_BUFFER_BYTES if shape.world_size > 1 else 0
        return CUDA_CONTEXT_BYTES + comm + CUDA_FRAGMENTATION * tensor_bytes
    return CPU_RUNTIME_BYTES + CPU_FRAGMENTATION * tensor_bytes


def overhead_terms(device: str) -> list[str]:
    """Plain-words description of the assumed overhead terms (shown in every plan)."""
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
