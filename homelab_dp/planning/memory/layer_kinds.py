"""Activations of each layer kind (issue 36): what one token saves for backward in a decoder
layer, by its mixer and its MLP (pure arithmetic, no torch).

`homelab_dp.planning.memory.device_memory` budgets a model of layer groups
(`ModelSpec.blocks`: hybrids, per-layer sizes) with `kind_activation_bytes` averaged over its
layers; the uniform form keeps its own (measured) formula. Elements per token, times the
compute width ``w`` unless said otherwise:

* every layer: the residual sums and per norm its input and output, fp32 as the uniform
  form (24·h bytes, 28·h in 16-bit), half of that for a layer of one sub-block (a Nemotron-H
  mixer-only or MLP-only layer); the per-token norm statistics.
* softmax attention (full, sliding, chunked, MLA): q and k after RoPE, v, the output
  (2·(heads·d) + 2·(kv·d)); with q/k norms their inputs and outputs (2·(heads + kv)·d); the
  gated attention of Qwen3-Next / Qwen3.5 also q_proj's doubled output, the sigmoid gate and
  the gated output (4·heads·d); SDPA's log-sum-exp (fp32, per head). Measured: exact for
  Nemotron-H's attention, within 2% for LFM2's and Qwen3.5's gated attention.
* Gated DeltaNet (``linear_attention``), as the torch reference path (transformers'
  ``torch_chunk_gated_delta_rule``) keeps it: the fused q/k/v projection and the convolution's
  output and activation (3·conv_dim, conv_dim = 2·k_heads·d_k + v_heads·d_v); q and k
  l2-normalised and repeated to the value heads (2·v_heads·d_k); z, β and the decay g; the
  chunk states (v_heads·d_k·d_v per chunk of `DELTA_CHUNK` tokens); the intra-chunk matrices
  (2·v_heads·C per token: the decay mask and the attention within the chunk); the core
  output, the gated norm's input and output (3·v_heads·d_v).
* Mamba-2 (``mamba2``), the torch reference (``torch_forward``'s SSD): in_proj's output
  (2·inner + 2·groups·state + heads), the convolution's output and activation (2·conv_dim),
  dt after softplus and the decay (2·heads), the chunk states (heads·d_head·state per chunk),
  the intra-chunk segment-sum matrix (heads·C per token), y, the gated norm's input and output
  (3·inner). ``attention+mamba2`` (Falcon-H1) saves both.
* short convolution (LFM2): in_proj's three outputs, B·x, the convolution and C·y (6·h).
* a generic recurrent mixer: 8·h (an estimate, said in the plan).
* the MLP: as `homelab_dp.planning.memory.moe_memory.kind_mlp_bytes`.

With activation checkpointing a layer keeps only its output (the residual, as the uniform form)
and recomputes the rest in backward: the per-kind bytes then matter only for the one layer in
hand (`device_memory._inside_backward`).

CUDA kernels: flash-linear-attention's chunked Gated DeltaNet and mamba-ssm's fused SSD keep the
chunk states in 16-bit and recompute the intra-chunk matrices in backward instead of saving
them; the plan budgets the reference path's bytes, an upper bound for the kernels (said in the
plan, `reference_path_note`).
"""

from __future__ import annotations

import importlib.util

from homelab_dp.planning.memory.moe_memory import kind_mlp_bytes
from homelab_dp.planning.model_spec import ATTENTION_KINDS, LayerKind, Mixer, ModelSpec

DELTA_CHUNK = 64
"""Gated DeltaNet's chunk length (transformers' torch reference and flash-linear-attention)."""

STATE_KIND_FIT = {"linear_attention": 2.16, "short_conv": 1.0}
"""Multipliers of the listed tensors, fitted on the bytes autograd saves on the CPU (fp32, the
torch reference kernels; `benchmarks/layer_kinds.py`, stable from 256 to 1024 tokens): the
reference chunked Gated DeltaNet keeps 2.16 times the tensors listed above (its padded,
reshaped and per-chunk copies); the short convolution is exact as listed."""
MAMBA_FIT = {"listed": 2.04, "states": 1.98, "chunk": 2.62, "heads_state": 3.80}
"""The reference SSD of Nemotron-H's Mamba-2 (Mamba-1: not measured, the same assumed), per
token: 2.04 times its chunk-independent tensors listed above, 1.98 times the chunk states
(heads·d_head·state / C), 2.62·heads·C (segment sums, decays, the intra-chunk products) and
3.80·heads·state (B and C repeated to the heads). Fitted by least squares on 15 layers
(hidden 64 and 256, 4 and 8 heads, state 16 and 64, chunk 16 to 256; 256 tokens, fp32, full
fine-tune): each within 5.2% (-5.2% at hidden 64, state 16, chunk 256). One multiplier of
the listed tensors (2.89, fitted at chunk 128 and state 64) was 20% over at chunk 16, and 10%
over for `measure` of the tiny nemotron_h (docs/models.md)."""

KERNELS = {
    "linear_attention": ("flash-linear-attention", "fla", 8.0),
    "mamba2": ("mamba-ssm and causal-conv1d", "mamba_ssm", 10.0),
    "mamba": ("mamba-ssm and causal-conv1d", "mamba_ssm", 10.0),
    "short_conv": ("causal-conv1d", "causal_conv1d", 1.5),
}
"""Per state mixer: the fast CUDA kernels' packages, the module to import, and how many times
slower the torch reference path runs that mixer on a GPU (the order of magnitude the kernels'
authors report; not measured here)."""


def mixer_elements(m: Mixer, hidden: int, masked_kv: bool = False) -> float:
    """Elements per token one mixer saves (times the compute width), beyond the residual."""
    if m.kind in ATTENTION_KINDS:
        attn = m.dim("heads", 1) * m.dim("head_dim", 1)
        kvd = m.dim("kv_heads", 0) * m.dim("head_dim", 1)
        if masked_kv:
            kvd = attn
        out = 2 * attn + 2 * kvd
        if m.params:  # q/k norms: each keeps its input and its output
            out += 2 * (attn + kvd)
        if m.kind == "gated_attention":
            out += 4 * attn  # q_proj's doubled output, the sigmoid gate, the gated output
        return float(out)
    if m.kind == "linear_attention":
        kh, vh = m.dim("k_heads", 1), m.dim("v_heads", 1)
        dk, dv = m.dim("k_dim", 1), m.dim("v_dim", 1)
        conv = 2 * kh * dk + vh * dv
        out = 3 * conv + 2 * vh * dk + vh * dv + 2 * vh
        out += vh * dk * dv / DELTA_CHUNK + 2 * vh * DELTA_CHUNK + 3 * vh * dv
        return out * STATE_KIND_FIT["linear_attention"]
    if m.kind in ("mamba2", "mamba"):
        heads, hd, n = m.dim("heads", 1), m.dim("head_dim", 1), m.dim("state", 16)
        inner, groups, c = m.dim("inner", heads * hd), m.dim("groups", 1), m.dim("chunk", 256)
        conv = inner + 2 * groups * n
        out = (2 * inner + 2 * groups * n + heads) + 2 * conv + 2 * heads
        out += 3 * inner
        fit = MAMBA_FIT
        return (out * fit["listed"] + heads * hd * n / c * fit["states"]
                + heads * c * fit["chunk"] + heads * n * fit["heads_state"])  # fmt: skip
    if m.kind == "short_conv":
        return 6.0 * m.dim("width", hidden) * STATE_KIND_FIT["short_conv"]
    return 8.0 * hidden


def kind_activation_bytes(
    spec: ModelSpec, kind: LayerKind, w: int, *, experts_trained: bool, frozen_norms: bool,
    masked_kv: bool = False,
) -> float:  # fmt: skip
    """Bytes one token saves in one layer of ``kind`` (no checkpointing; LoRA's outputs apart)."""
    h = spec.hidden
    subs = len(kind.mixers) > 0 and (bool(kind.mlp) or kind.experts is not None)
    base = (24 * h if w == 4 else 28 * h) * (1.0 if subs else 0.5)
    if frozen_norms:
        base -= (2 if subs else 1) * 4 * h
    heads = sum(m.dim("heads", 0) for m in kind.mixers)
    out = base + 4 * (2 + heads)
    out += w * sum(mixer_elements(m, h, masked_kv) for m in kind.mixers)
    out += kind_mlp_bytes(kind, h, w, experts_trained, spec.model_type)
    return out


def blocks_activation_bytes(
    spec: ModelSpec, w: int, *, experts_trained: bool, frozen_norms: bool, masked_kv: bool = False,
    seq_len: int = 0,
) -> float:  # fmt: skip
    """`kind_activation_bytes` averaged over the layers (the per-layer figure the uniform form
    gives), with SDPA's additive mask per attention layer when the route masks."""
    total = 0.0
    for g in spec.layer_groups:
        per = kind_activation_bytes(spec, g.kind, w, experts_trained=experts_trained,
                                    frozen_norms=frozen_norms, masked_kv=masked_kv)  # fmt: skip
        if masked_kv and any(m.kind in ATTENTION_KINDS for m in g.kind.mixers):
            per += seq_len * w
        total += g.count * per
    return total / max(1, spec.layers)


def installed_kernels() -> set[str]:
    """The fast kernels' modules installed here (found, not imported: planning stays pure)."""
    found = set()
    for _, module, _ in KERNELS.values():
        try:
            if importlib.util.find_spec(module) is not None:
                found.add(module)
        except (ImportError, ValueError):
            continue
    return found


def reference_path_note(spec: ModelSpec, installed: set[str], device: str) -> str | None:
    """What the plan says about the state mixers' kernels: on CUDA without the fast kernels the
    run takes the torch reference path (how much slower); None for a model without them."""
    kinds = {m.kind for g in spec.layer_groups for m in g.kind.mixers if m.kind in KERNELS}
    if not kinds:
        return None
    missing = sorted({KERNELS[k][0] for k in kinds if KERNELS[k][1] not in installed})
    slow = max((KERNELS[k][2] for k in kinds if KERNELS[k][1] not in installed), default=1.0)
    counts = ", ".join(f"{n} {k}" for k, n in spec.mixer_counts.items())
    memory = ("Memory budgets the torch reference path's saved tensors (chunk states, "
              "intra-chunk matrices), an upper bound for the fused CUDA kernels.")  # fmt: skip
    if device != "cuda":
        return f"Layers: {counts}. They run the torch reference path on the CPU. {memory}"
    if not missing:
        return f"Layers: {counts}. The fast CUDA kernels are installed. {memory}"
    return (
        f"Layers: {counts}. {' and '.join(missing)} not installed: those mixers run the torch "
        f"reference path, about {slow:g}x slower per mixer (pip install 'homelab-dp[kernels]'). {memory}"
    )


def gemma4_layer_extra_bytes(spec: ModelSpec, w: int) -> float:
    """Bytes per token a Gemma 4 decoder layer saves beyond the LLaMA form, for the uniform
    spec (`layer_activation_bytes`): the pre- and post-feedforward norms, with the MoE block
    the post norms of its two branches, and the per-layer input's norm, each keeping its fp32
    input and statistics (4·h + 8); with the MoE block the dense MLP beside the experts (gate,
    up, the activation, their product: 4·intermediate, and its input); the per-layer input's
    gate and projection (h + 2·its width). Measured on the tiny gemma4_text (hidden 64, MoE
    block, per-layer inputs of 8, LoRA, fp32): 7.7 to 8.2 KB per token and layer against 4.3
    KB without these terms (`measure` was 15% under the plan), 8.0 to 8.5 KB with them."""
    h = spec.hidden
    widths = {lin.name: lin.d_out for lin in spec.linears}
    moe = spec.experts is not None
    per_layer = widths.get("per_layer_input_gate", 0)
    norms = 2 + (2 if moe else 0) + (1 if per_layer else 0)
    out = norms * (4.0 * h + 8)
    if moe:
        out += w * (4 * widths.get("mlp.gate_proj", 0) + h)
    if per_layer:
        out += w * (h + 2 * per_layer)
    return out
