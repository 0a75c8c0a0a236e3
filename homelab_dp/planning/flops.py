"""Model FLOPs per trained token and the cards' 16-bit peaks: MFU (pure: stdlib only).

MFU (model FLOPs utilisation) = model FLOPs per token × tokens per second ÷ (the card's dense
16-bit tensor peak × the number of cards). Model FLOPs count the matrix multiplications the
model's maths needs, not what a kernel happens to run: embeddings are a lookup (0 FLOPs),
norms, activations and the softmax are left out (a few percent at most), and the attention
term counts only the keys a causal query attends to.

Per trained token (N = weights of the matmuls a token goes through: every decoder linear and the
lm_head, which multiplies by the vocabulary even when it is tied to the embeddings; in a
Mixture-of-Experts model the router, the shared experts and only the top-k routed experts of
each MoE layer, the dense layers' MLP in the others — the *active* parameters; S = the
attention span):

- forward: 2·N for the linears, plus 2·2·layers·(heads·head_dim)·S for scores and values
  (Q·Kᵀ and P·V; grouped KV heads share K and V but every query head still multiplies);
- backward, full fine-tune: 2× the forward (the input gradient and the weight gradient);
- backward, LoRA/QLoRA: the frozen base still passes the input gradient down (1× its forward)
  but makes no weight gradient; the adapters (r·(d_in + d_out) weights each) cost 3× their
  forward like any trained layer; attention has no weights, so its backward is 2× either way;
- activation checkpointing recomputes the decoder layers' forward once in the backward pass
  (not the lm_head, which sits outside the checkpointed blocks); counted, as it is work done.

QLoRA dequantizes its 4-bit weights to 16 bits before each matmul: the same FLOPs as LoRA.
Adapters on routed experts (peft's ``target_parameters``) count like the experts: top-k of E
per token.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from homelab_dp.planning.memory.moe_memory import (
    adapted,
    adapted_experts,
    lora_param_count,
    named_experts,
)
from homelab_dp.planning.model_spec import Linear, Mixer, ModelSpec
from homelab_dp.vocabulary import PREFERENCE_OBJECTIVES

METHODS = ("full", "lora", "qlora")


def causal_span(seq_len: int) -> float:
    """Mean keys a query attends to under a causal mask over ``seq_len`` positions: (L + 1) / 2.

    Query i (1-based) sees i keys, so the mean over a block is (L + 1) / 2. Packed blocks attend
    causally across the whole block, so this is their span too. (PaLM's 6N + 12·layers·d·L
    counts the full L; fused kernels skip the masked half, so the causal mean is the honest one.)
    """
    return (max(int(seq_len), 0) + 1) / 2


def _weights(linears: Iterable[Linear]) -> int:
    """Weights of some linears (biases left out)."""
    return sum(lin.d_in * lin.d_out for lin in linears)


def linear_matmul_params(spec: ModelSpec) -> int:
    """N: weights multiplied per token by the decoder linears and the lm_head (biases left out).

    A MoE layer multiplies by the router, the shared experts and top-k routed experts (the
    active parameters, `ModelSpec.active_params`), a MoE model's dense layer by `dense_mlp`."""
    if spec.blocks:
        out = spec.vocab * spec.hidden
        for g in spec.blocks:
            k = g.kind
            out += g.count * _weights(k.linears)
            if k.experts is not None:
                e = k.experts
                # the routed experts at top-k, the router, a shared expert's own gate
                route = e.top_k * _weights(e.linears) + e.count * spec.hidden + e.shared_gate_params
                out += g.count * route
        return out
    out = spec.layers * _weights(spec.linears) + spec.vocab * spec.hidden
    e = spec.experts
    if e is not None:
        router = e.count * spec.hidden  # the router: hidden → one logit per expert
        out += e.layers * (e.top_k * _weights(e.linears) + _weights(e.shared) + router)
        out += (spec.layers - e.layers) * _weights(spec.dense_mlp)
    return out


def adapter_params_per_token(spec: ModelSpec, lora_r: int, lora_targets: str | list[str]) -> float:
    """LoRA weights a token multiplies by: every adapter, but of those on routed experts only
    the top-k experts' share."""
    total = float(lora_param_count(spec, lora_r, lora_targets))
    if spec.blocks:
        skipped = 0.0
        for g in spec.blocks:
            e = g.kind.experts
            if e is not None:
                named = named_experts(e.linears, lora_targets)
                per = sum(lora_r * (lin.d_in + lin.d_out) for lin in named) * e.count * g.count
                skipped += per * (1 - e.top_k / e.count)
        return total - skipped
    experts = adapted_experts(spec, lora_targets)
    if spec.experts is None or not experts:
        return total
    chosen = {id(lin) for lin in experts}
    routed = sum(n * lora_r * (lin.d_in + lin.d_out)
                 for lin, n in adapted(spec, lora_targets) if id(lin) in chosen)  # fmt: skip
    return total - routed * (1 - spec.experts.top_k / spec.experts.count)


def attention_forward_flops(spec: ModelSpec, attention_span: float) -> float:
    """Q·Kᵀ and P·V of one token's queries against ``attention_span`` keys, in every layer; for
    a model of layer groups (`ModelSpec.blocks`) the token-mixing FLOPs of every mixer kind
    (`mixer_forward_flops`)."""
    if spec.blocks:
        return sum(
            g.count * mixer_forward_flops(m, attention_span)
            for g in spec.blocks
            for m in g.kind.mixers
        )
    return 2 * 2 * spec.layers * spec.heads * spec.head_dim * float(attention_span)


DELTA_CHUNK = 64
"""Gated DeltaNet's chunk length (flash-linear-attention's chunked kernel and transformers'
torch reference both use 64)."""


def mixer_forward_flops(mixer: Mixer, attention_span: float) -> float:
    """Forward FLOPs per token of one mixer beyond its linears (the linears are in
    `linear_matmul_params`).

    Softmax attention: Q·Kᵀ and P·V against the span (a sliding or chunked layer's span is at
    most its window). Gated DeltaNet (chunked form, chunk C = `DELTA_CHUNK`): per value head the
    state read and update (about 4·d_k·d_v) and the intra-chunk products (2·C·(d_k + d_v)).
    Mamba-2 (SSD, chunk C): per head the state terms (3·d_head·d_state) and the intra-chunk
    products (C·(d_state + d_head)). Short convolutions: 2·width·kernel. A generic recurrent
    mixer: its state update, counted as 4·hidden (small beside its linears)."""
    span = float(attention_span)
    if mixer.kind in (
        "attention",
        "sliding_attention",
        "chunked_attention",
        "mla",
        "gated_attention",
    ):
        window = mixer.dim("window")
        if window:
            span = min(span, float(window))
        return 2 * 2 * mixer.dim("heads", 1) * mixer.dim("head_dim", 1) * span
    if mixer.kind == "linear_attention":
        dk, dv = mixer.dim("k_dim", 1), mixer.dim("v_dim", 1)
        c = min(DELTA_CHUNK, max(1.0, span * 2))
        return 2 * mixer.dim("v_heads", 1) * (4 * dk * dv + 2 * c * (dk + dv))
    if mixer.kind in ("mamba2", "mamba"):
        hd, n = mixer.dim("head_dim", 1), mixer.dim("state", 16)
        c = min(mixer.dim("chunk", 256), max(1.0, span * 2))
        return 2 * mixer.dim("heads", 1) * (3 * hd * n + c * (n + hd))
    if mixer.kind == "short_conv":
        return 2 * mixer.dim("width", 1) * mixer.dim("conv_kernel", 3)
    return 4 * mixer.dim("width", 1)


def flops_per_token(
    spec: ModelSpec,
    *,
    method: str,
    activation_checkpointing: bool,
    attention_span: float,
    lora_r: int = 16,
    lora_targets: str | list[str] = "all-linear",
) -> float:
    """Matmul FLOPs of one trained token: forward, backward and any recomputation.

    ``attention_span``: mean keys per query (`causal_span` of the block length for causal
    blocks). ``lora_r`` and ``lora_targets`` (the preset's ``lora`` section) size the adapters of
    ``lora``/``qlora``; ``full`` ignores them. Raises ValueError for another method ("auto" must
    be resolved first).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {', '.join(METHODS)}, got {method!r}")
    head = 2.0 * spec.vocab * spec.hidden
    layers_fwd = 2.0 * linear_matmul_params(spec) - head
    attn_fwd = attention_forward_flops(spec, attention_span)
    adapters_fwd = 0.0
    if method == "full":
        backward_factor = 2.0  # input and weight gradients of every linear
    else:
        backward_factor = 1.0  # frozen base: the input gradient only
        adapters_fwd = 2.0 * adapter_params_per_token(spec, lora_r, lora_targets)
    total = (
        (1 + backward_factor) * (layers_fwd + head)
        + 3 * attn_fwd  # no weights: backward is 2× forward for every method
        + 3 * adapters_fwd  # trained: input and weight gradients
    )
    if activation_checkpointing:
        total += layers_fwd + attn_fwd + adapters_fwd
    return total


# One row a card: (dense 16-bit TFLOPS, peak memory bandwidth GB/s).
# TFLOPS: dense (no 2:4 sparsity) bf16/fp16 tensor-core rate with fp32 accumulate, at the boost
# clock, from NVIDIA's datasheets and architecture whitepapers (Volta/Turing/Ampere GA100 and
# GA102, Ada, Hopper, Blackwell RTX): the datasheet's "with sparsity" figure halved. GeForce
# cards (and the 2080 Ti) accumulate fp32 at half their fp16-accumulate rate; training
# accumulates in fp32, so theirs is the halved figure (RTX 4090: 330.3 fp16-acc, 165.2
# fp32-acc). Workstation and data-centre cards run fp32 accumulate at full rate. Pascal has no
# tensor cores: P100's fp16 rate; P40's fp16 is 1/64 rate, so its fp32 rate (what it trains in).
# Bandwidth: GB/s (10^9 bytes/s) from NVIDIA's datasheets and product pages (the figure the
# vendor publishes, memory clock × bus width): what bounds decoding, where every new token reads
# the weights and the KV cache once (`homelab_dp.planning.grpo_plan`); an A100 or A800 without
# "80GB" in its name is taken as the 40 GB card (the lower figure).
# Keys are the words of the name (lower case, "-" and "_" as spaces) that must appear in order.
CARD_PEAKS: dict[tuple[str, ...], tuple[float, float]] = {
    # Blackwell data centre: the datasheets' sparse FP16/BF16 halved (HGX B200: 4.5 PFLOPS
    # sparse a GPU; GB200 NVL72: 5 PFLOPS sparse a GPU; HGX B100: 3.5)
    ("b200",): (2250.0, 8000.0),  # memory: HGX B200: 8 TB/s a GPU
    ("gb200",): (2500.0, 8000.0),  # memory: GB200 NVL72: 8 TB/s a GPU
    ("b100",): (1750.0, 8000.0),  # memory: HGX B100: 8 TB/s a GPU
    # Hopper data centre
    # Grace Hopper: the H100 SXM5's tensor cores; memory: GH200 96 GB HBM3 (the 144 GB
    # HBM3e part: 4.9 TB/s)
    ("gh200",): (989.5, 4000.0),
    ("h200",): (989.5, 4800.0),  # H200 SXM; memory: H200 SXM, HBM3e
    ("h200", "nvl"): (835.5, 4800.0),
    ("h100",): (989.5, 3350.0),  # "NVIDIA H100 80GB HBM3" is the SXM5 card, 80 GB HBM3
    ("h100", "sxm"): (989.5, 3350.0),
    ("h100", "pcie"): (756.5, 2000.0),  # memory: HBM2e
    ("h100", "nvl"): (835.5, 3900.0),
    ("h800",): (989.5, 3350.0),
    ("h800", "pcie"): (756.5, 2000.0),
    # Ampere data centre and workstation
    ("a100",): (312.0, 1555.0),  # SXM4 and PCIe alike; memory: 40 GB (SXM4 and PCIe)
    ("a100", "sxm4", "80gb"): (312.0, 2039.0),  # the A100's tensor cores
    ("a100", "80gb", "pcie"): (312.0, 1935.0),  # the A100's tensor cores
    ("a30",): (165.0, 933.0),
    ("a800",): (312.0, 1555.0),  # memory: 40 GB PCIe
    ("a800", "sxm4", "80gb"): (312.0, 2039.0),  # the A800's tensor cores
    ("a800", "80gb", "pcie"): (312.0, 1935.0),  # the A800's tensor cores
    ("a40",): (149.7, 696.0),
    ("a6000",): (154.8, 768.0),  # RTX A6000
    ("a5000",): (111.1, 768.0),
    ("a4000",): (76.7, 448.0),
    # Ada data centre and workstation
    ("l40s",): (362.05, 864.0),
    ("l40",): (181.05, 864.0),
    ("l4",): (121.0, 300.0),
    ("rtx", "6000", "ada"): (364.2, 960.0),
    # GeForce Blackwell (fp32 accumulate: half the fp16-accumulate figure)
    ("rtx", "5090"): (209.5, 1792.0),
    ("rtx", "5080"): (112.6, 960.0),
    ("rtx", "5070", "ti"): (87.9, 896.0),
    ("rtx", "5070"): (61.7, 672.0),
    ("rtx", "5060", "ti"): (47.4, 448.0),
    ("rtx", "5060"): (38.4, 448.0),
    # GeForce Ada
    ("rtx", "4090"): (165.2, 1008.0),
    ("rtx", "4080"): (97.5, 716.8),
    ("rtx", "4070", "ti"): (80.2, 504.2),
    ("rtx", "4070"): (58.4, 504.2),
    ("rtx", "4060", "ti"): (44.2, 288.0),
    # GeForce Ampere
    ("rtx", "3090", "ti"): (80.0, 1008.0),
    ("rtx", "3090"): (71.0, 936.2),
    ("rtx", "3080", "ti"): (68.2, 912.4),
    ("rtx", "3080"): (59.5, 760.3),  # memory: 10 GB (the 12 GB card: 912)
    ("rtx", "3070"): (40.6, 448.0),
    ("rtx", "3060"): (25.6, 360.0),  # memory: 12 GB
    # Turing and Volta (fp16: Volta/Turing have no bf16)
    ("titan", "rtx"): (130.5, 672.0),
    ("rtx", "2080", "ti"): (53.8, 616.0),
    ("t4",): (65.0, 320.0),
    ("v100",): (125.0, 900.0),  # SXM2/SXM3; memory: SXM2 (32 GB SXM3: 900 too)
    ("v100", "pcie"): (112.0, 900.0),
    ("v100s",): (130.0, 1134.0),
    # Pascal: no tensor cores
    ("p100",): (21.2, 732.0),  # SXM2; memory: SXM2 and PCIe 16 GB
    ("p100", "pcie"): (18.7, 732.0),
    ("p40",): (11.76, 347.0),
}
"""GPU name words → (dense 16-bit tensor TFLOPS with fp32 accumulate, peak memory bandwidth
GB/s), one card."""

PEAK_DENSE_16BIT_TFLOPS: dict[tuple[str, ...], float] = {k: v[0] for k, v in CARD_PEAKS.items()}
"""GPU name words → dense 16-bit tensor TFLOPS with fp32 accumulate (one card)."""

MEMORY_BANDWIDTH_GBPS: dict[tuple[str, ...], float] = {k: v[1] for k, v in CARD_PEAKS.items()}
"""GPU name words → peak memory bandwidth, GB/s (one card)."""

VARIANT_WORDS = frozenset({"ti", "super", "d", "laptop", "mobile", "max", "q"})
"""A word right after a matched model that makes it another card (RTX 4090 D, 4080 SUPER, a
laptop part): that card is unknown unless the table names it."""


def _words(name: str) -> list[str]:
    return re.sub(r"[-_/()]+", " ", name.lower()).split()


def _match_end(words: list[str], key: tuple[str, ...]) -> int | None:
    """The index after ``key`` where it occurs as consecutive whole words, else None."""
    n = len(key)
    for i in range(len(words) - n + 1):
        if tuple(words[i : i + n]) == key:
            return i + n
    return None


MIG_COMPUTE_SLICES: dict[tuple[str, ...], int] = {("a30",): 4}
"""Compute slices (GPCs) of a card that MIG divides; 7 for every other MIG card (A100, H100,
H200, B200). A ``3g.40gb`` instance of an A100 has 3 of its 7."""


def mig_share(gpu_name: str) -> float:
    """The share of its card's compute a MIG instance has, from its name (``NVIDIA
    A100-SXM4-80GB MIG 3g.40gb`` → 3/7); 1.0 for a whole card."""
    m = re.search(r"\bmig\s+(\d+)g\.", gpu_name.lower())
    if not m:
        return 1.0
    words = _words(gpu_name)
    total = next((n for key, n in MIG_COMPUTE_SLICES.items() if _match_end(words, key)), 7)
    return min(int(m.group(1)), total) / total


def _lookup(table: dict[tuple[str, ...], float], gpu_name: str) -> float | None:
    """The entry of ``table`` for ``gpu_name``: the longest key whose words occur whole and in
    order, not followed by a variant word; None when none does."""
    words = _words(gpu_name)
    best: tuple[int, float] | None = None
    for key, value in table.items():
        end = _match_end(words, key)
        if end is None or (end < len(words) and words[end] in VARIANT_WORDS):
            continue
        if best is None or len(key) > best[0]:
            best = (len(key), value)
    return None if best is None else best[1]


def peak_flops(gpu_name: str) -> float | None:
    """The dense 16-bit peak (FLOP/s, one card) of an NVML/torch GPU name; None when unknown.

    The longest table key whose words occur whole and in order wins ("H100 PCIe" over "H100");
    a match followed by a variant word ("RTX 4090 D", "RTX 4080 SUPER", "Laptop GPU") does not
    count, so an unlisted variant is None rather than the wrong card's peak. A MIG instance
    (``… MIG 3g.40gb``) has its share of the card's compute slices (`mig_share`).
    """
    tflops = _lookup(PEAK_DENSE_16BIT_TFLOPS, gpu_name)
    return None if tflops is None else tflops * 1e12 * mig_share(gpu_name)


def memory_bandwidth(gpu_name: str) -> float | None:
    """The card's peak memory bandwidth (bytes/s) of an NVML/torch GPU name, matched as
    `peak_flops` matches (`MEMORY_BANDWIDTH_GBPS`); None when unknown. A MIG instance has
    its share of the card's memory slices, taken as its share of the compute slices."""
    gbps = _lookup(MEMORY_BANDWIDTH_GBPS, gpu_name)
    return None if gbps is None else gbps * 1e9 * mig_share(gpu_name)


def mfu(
    tokens_per_s: float, flops_per_token: float, peak: float | None, world_size: int
) -> float | None:
    """Model FLOPs achieved ÷ the peak of ``world_size`` cards (0..1); None without a peak.

    ``tokens_per_s`` counts the tokens of every rank together; ``peak`` is one card's FLOP/s
    (`peak_flops`), every card taken to be the same.
    """
    if not peak or peak <= 0 or world_size < 1 or tokens_per_s < 0:
        return None
    return tokens_per_s * flops_per_token / (peak * world_size)


def no_grad_forward_flops_per_token(spec: ModelSpec, *, attention_span: float) -> float:
    """Matmul FLOPs of one token through a no-grad forward of the base model (the reference
    model's forward, adapters disabled or a frozen copy; the precompute pass): 2·N + attention.
    A policy's no-grad forward with adapters (KTO's KL forward) adds their 2·r·(d_in + d_out),
    well under 1% of this, left out."""
    return 2.0 * linear_matmul_params(spec) + attention_forward_flops(spec, attention_span)


def no_grad_forwards(objective: str, reference: str | None) -> int:
    """The no-grad forwards a micro-batch of ``objective`` runs beside the policy's: the
    reference's (``reference`` "adapters" or "copy") and KTO's KL forward; 0 for SFT and GRPO
    and for a precomputed reference (its pass runs once before training)."""
    if objective not in PREFERENCE_OBJECTIVES:
        return 0
    return (1 if reference in ("adapters", "copy") else 0) + (1 if objective == "kto" else 0)


def objective_flops_factor(
    spec: ModelSpec, *, objective: str, reference: str, attention_span: float, **train: Any
) -> float:
    """A step's model FLOPs ÷ what `flops_per_token` counts for its trained tokens (≥ 1).

    `flops_per_token` stays "per trained token": a preference objective trains both sequences of
    each pair, so its tokens are already 2 × micro × seq_len per micro-batch. What it does not
    count are the no-grad forwards beside the policy's: DPO/KTO's reference forward (reference
    adapters or copy: one forward of the base per token) and KTO's KL forward (one more, of the
    policy without grad). ``reference`` is the resolved one ("none", "adapters", "precompute",
    "copy"); precompute's pass runs once before training and is priced apart
    (`homelab_dp.planning.objective_cost`). SFT and ORPO: 1.0. ``attention_span``: the mean keys
    a query attends to (`causal_span` of one sequence: a pair's sequences never attend to each
    other). ``train``: `flops_per_token`'s other keywords (method, activation_checkpointing,
    lora_r, lora_targets).
    """
    forwards = no_grad_forwards(objective, reference)
    if forwards == 0:
        return 1.0
    train = flops_per_token(spec, attention_span=attention_span, **train)
    extra = forwards * no_grad_forward_flops_per_token(spec, attention_span=attention_span)
    return (train + extra) / train
