"""What a Mixture-of-Experts model, a multimodal wrapper and LoRA on either add to the memory
model (pure arithmetic, no torch).

`homelab_dp.planning.memory.device_memory` budgets every model the same way; this module holds
the parts that depend on the model's MoE block (`ModelSpec.experts`), its dense layers
(`ModelSpec.dense_mlp`) and its frozen vision tower (`ModelSpec.vision_params`):

* LoRA targets on a MoE model (`adapted`): "all-linear" adapts attention, the dense layers' MLP
  and the shared experts (``nn.Linear``); the routed experts only when ``lora.target_modules``
  names "experts" (or "experts.gate_up_proj", ...). peft adapts a fused 3-D expert weight
  ``[E, out, in]`` through ``target_parameters`` (``ParamWrapper``): lora_A ``in × r·E`` and
  lora_B ``r·E × out``, the same count as E separate adapters. Its forward folds ``W + B·A``
  into a new ``[E, out, in]`` tensor in the compute dtype (``torch.baddbmm``), which the expert
  matmul saves for backward: one such tensor per adapted expert weight per MoE layer
  (`merged_expert_bytes`). The router is never adapted.
* Activations of routed tokens (`moe_mlp_bytes`), as transformers' default experts
  implementation (``grouped_mm``, `transformers.integrations.moe`) saves them, measured on the
  CPU with `homelab_dp.train.loop.memtrack.LiveTensors` (tiny qwen3_moe, fp32 and bf16, E, top-k and
  the expert width varied one at a time): per token the router's fp32 softmax (4·E bytes) and
  4 bytes; per routed slot (top-k of them per token) the int64 sort and index tensors (40
  bytes) and, with the experts trained (full fine-tune or adapted), the gathered hidden state,
  gate_up's output, the activation, its product and the down projection's output
  (``w·(4·i + 2·h)``); with the experts frozen the gathered input is not saved and the product
  neither (``w·(3·i + h)``). gpt-oss's clamped gate (``(up + 1)·gate·σ(α·gate)``) keeps three
  intermediate-wide tensors more per slot (`GATE_TENSORS`, measured the same way).
* The sizes of one decoder layer (`largest_layer_params`) and of the largest tensor a QLoRA
  load reads whole (`largest_quantized`: a MoE layer's fused stack) and of the weight a matmul
  holds dequantized (`largest_dequantized`: a group of routed experts at a time, one expert
  where an expert fills the group).
"""

from __future__ import annotations

from homelab_dp.planning.model_layers import lora_can_adapt
from homelab_dp.planning.model_spec import LayerKind, Linear, ModelSpec

ROUTED_INDEX_BYTES = 40
"""int64 sort, permutation and index tensors saved per routed slot (measured)."""
ROUTER_TOKEN_BYTES = 4
"""Saved per token beside the router's fp32 softmax (measured)."""
GATE_TENSORS: dict[str, tuple[int, int]] = {"gpt_oss": (7, 6)}
"""Intermediate-wide tensors a routed slot saves (experts trained, experts frozen), for the
families whose expert activation is not SwiGLU's (4, 3) (measured)."""


def _names(targets: str | list[str] | tuple[str, ...]) -> set[str] | None:
    """The target module names; None for "all-linear"."""
    if isinstance(targets, str):
        return None if targets == "all-linear" else {targets}
    return set(targets)


def _picked(lin: Linear, names: set[str] | None) -> bool:
    """Whether a name list picks an ``nn.Linear`` (peft matches the last component or the path)."""
    if names is None:
        return True
    return lin.name in names or lin.name.split(".")[-1] in names


def adapted_experts(spec: ModelSpec, targets: str | list[str] | tuple[str, ...]) -> list[Linear]:
    """The routed experts' weights LoRA adapts: those named ("experts" names them all)."""
    if spec.experts is None:
        return []
    return named_experts(spec.experts.linears, targets)


def named_experts(
    linears: tuple[Linear, ...], targets: str | list[str] | tuple[str, ...]
) -> list[Linear]:
    names = _names(targets)
    if names is None:
        return []
    if "experts" in names:
        return list(linears)
    return [
        lin for lin in linears if f"experts.{lin.name.split('.')[-1]}" in names
        or lin.name in names
    ]  # fmt: skip


def adapted(
    spec: ModelSpec, targets: str | list[str] | tuple[str, ...]
) -> list[tuple[Linear, int]]:
    """Every adapted weight with how many copies of it the model holds (layers × experts).

    A dense model: the picked `ModelSpec.linears` in every layer (as `ModelSpec.lora_params`).
    A MoE model also: the dense layers' MLP, the shared experts in every MoE layer and, when
    named, the routed experts (E per MoE layer)."""
    names = _names(targets)
    if spec.blocks:  # every layer group: its linears, shared experts and named routed experts
        out = []
        for g in spec.blocks:
            out += [
                (lin, g.count) for lin in g.kind.linears
                if _picked(lin, names) and lora_can_adapt(spec.model_type, lin.name)
            ]  # fmt: skip
            if g.kind.experts is not None:
                e = g.kind.experts
                out += [(lin, g.count * e.count) for lin in named_experts(e.linears, targets)]
        return out
    out = [(lin, spec.layers) for lin in spec.linears if _picked(lin, names)]
    if spec.experts is None:
        return out
    moe, dense = spec.experts.layers, spec.layers - spec.experts.layers
    out += [(lin, dense) for lin in spec.dense_mlp if dense and _picked(lin, names)]
    out += [(lin, moe) for lin in spec.experts.shared if _picked(lin, names)]
    out += [(lin, moe * spec.experts.count) for lin in adapted_experts(spec, targets)]
    return out


def lora_param_count(spec: ModelSpec, r: int, targets: str | list[str] | tuple[str, ...]) -> int:
    """Trainable LoRA parameters: r·(d_in + d_out) per adapted weight (`adapted`)."""
    return sum(n * r * (lin.d_in + lin.d_out) for lin, n in adapted(spec, targets))


def lora_outputs_per_layer(spec: ModelSpec, targets: str | list[str] | tuple[str, ...]) -> float:
    """Adapted ``nn.Linear``s per decoder layer, averaged over the layers: each saves its
    lora_A output (r per token). Expert adapters are folded into the weight (no such output)."""
    if spec.blocks:
        names = _names(targets)
        picked = sum(
            g.count for g in spec.blocks for lin in g.kind.linears
            if _picked(lin, names) and lora_can_adapt(spec.model_type, lin.name)
        )  # fmt: skip
        return picked / max(1, spec.layers)
    experts = set(id(lin) for lin in adapted_experts(spec, targets))
    rows = [(lin, n) for lin, n in adapted(spec, targets) if id(lin) not in experts]
    return sum(n for _, n in rows) / max(1, spec.layers)


def expert_width(spec: ModelSpec) -> int:
    """One routed expert's intermediate width (the down projection's input)."""
    assert spec.experts is not None
    return min(lin.d_in for lin in spec.experts.linears)


def dense_width(spec: ModelSpec) -> int:
    """The intermediate width of a dense layer's MLP (`ModelSpec.intermediate` for a dense model)."""
    if spec.dense_mlp:
        return min(lin.d_in for lin in spec.dense_mlp)
    return spec.intermediate


def moe_mlp_bytes(spec: ModelSpec, width: int, experts_trained: bool) -> float:
    """Bytes one token saves in a MoE layer's MLP block (routed and shared experts).

    ``width``: the activations' element size; ``experts_trained``: the routed experts get
    gradients (full fine-tune, or LoRA naming them)."""
    assert spec.experts is not None
    e, h, i = spec.experts, spec.hidden, expert_width(spec)
    trained, frozen = GATE_TENSORS.get(spec.model_type, (4, 3))
    wide = trained * i + 2 * h if experts_trained else frozen * i + h
    per_slot = width * wide + ROUTED_INDEX_BYTES
    # A shared expert saves what a dense MLP does: gate, up, the activation and the product.
    shared = 2 * sum(lin.d_out for lin in e.shared if lin.d_in == h)
    return e.top_k * per_slot + 4 * e.count + ROUTER_TOKEN_BYTES + width * shared


def mlp_bytes_per_layer(spec: ModelSpec, width: int, experts_trained: bool) -> float:
    """A layer's MLP activations per token, averaged over the decoder layers (MoE and dense)."""
    dense = 4 * dense_width(spec) * width
    if spec.experts is None:
        return dense
    moe = spec.experts.layers
    return (moe * moe_mlp_bytes(spec, width, experts_trained) + (spec.layers - moe) * dense) / (
        spec.layers
    )


def merged_expert_bytes(
    spec: ModelSpec, targets: str | list[str] | tuple[str, ...], width: int
) -> int:
    """Per MoE layer, the folded ``W + B·A`` expert weights saved for backward (bytes)."""
    if spec.experts is None:
        return 0
    chosen = adapted_experts(spec, targets)
    return spec.experts.count * sum(lin.d_in * lin.d_out for lin in chosen) * width


def decoder_params(spec: ModelSpec) -> int:
    """Every decoder layer's parameters together (experts included; embeddings, lm_head, the
    final norm and the vision tower left out)."""
    return (
        spec.params
        - spec.embedding_params
        - spec.lm_head_params
        - spec.final_norm_params
        - spec.vision_params
        - spec.extra_params
    )


def largest_layer_params(spec: ModelSpec) -> int:
    """The parameters of the largest decoder layer (a MoE layer holds all its experts)."""
    if spec.blocks:
        return max(g.kind.params for g in spec.blocks)
    if spec.experts is None:
        return spec.layer_params
    dense = sum(lin.params for lin in spec.dense_mlp)
    return spec.layer_params + max(spec.experts.layer_params, dense)


def largest_quantized(spec: ModelSpec) -> int:
    """Elements of the largest weight QLoRA dequantizes for one matmul: a linear, or a fused
    expert stack ``[E, out, in]`` (dequantized whole for the grouped matmul)."""
    sizes = [lin.d_in * lin.d_out for lin in (*spec.linears, *spec.dense_mlp)]
    for g in spec.blocks:
        e = g.kind.experts
        if e is not None:
            sizes += [(e.count if e.fused else 1) * lin.d_in * lin.d_out for lin in e.linears]
    if spec.experts is not None:
        sizes += [lin.d_in * lin.d_out for lin in spec.experts.shared]
        stack = spec.experts.count if spec.experts.fused else 1
        sizes += [stack * lin.d_in * lin.d_out for lin in spec.experts.linears]
    return max(sizes, default=0)


DEQUANT_GROUP_ELEMENTS = 1 << 20
"""Values of routed experts' weights the NF4 experts dequantize together in one call, at least
one expert (`homelab_dp.nf4_quantization.DEQUANT_GROUP_ELEMENTS`: a test keeps them equal)."""


def dequantized_group(count: int, expert_elements: int) -> int:
    """Elements a group of routed experts holds dequantized at once: as many experts of
    ``expert_elements`` values as `DEQUANT_GROUP_ELEMENTS` holds, at least one, at most
    ``count``."""
    return expert_elements * max(1, min(count, DEQUANT_GROUP_ELEMENTS // max(expert_elements, 1)))


def largest_dequantized(spec: ModelSpec) -> int:
    """Elements of the largest weight a QLoRA matmul holds dequantized: a linear, or one group
    of routed experts' weights (the NF4 experts, `homelab_dp.nf4_quantization.nf4_experts_forward`,
    dequantize the routed experts a group at a time, again in backward: `dequantized_group`,
    one expert where an expert alone fills the group; never the fused stack whole; the load
    does read the stack whole, `largest_quantized`)."""
    sizes = [lin.d_in * lin.d_out for lin in (*spec.linears, *spec.dense_mlp)]
    if spec.experts is not None:
        sizes += [lin.d_in * lin.d_out for lin in spec.experts.shared]
        count = spec.experts.count if spec.experts.fused else 1
        sizes += [dequantized_group(count, lin.d_in * lin.d_out) for lin in spec.experts.linears]
    return max(sizes, default=0)


def mlp_temporaries(spec: ModelSpec) -> int:
    """Elements per token of a layer's MLP backward temporaries beyond the hidden size: two
    intermediate-wide gradients per dense MLP, per routed slot in a MoE layer."""
    if spec.blocks:
        return max(kind_mlp_temporaries(g.kind, spec.hidden) for g in spec.blocks)
    dense = 2 * dense_width(spec)
    if spec.experts is None:
        return dense
    routed = spec.experts.top_k * (2 * expert_width(spec) + spec.hidden)
    return max(dense if spec.dense_mlp else 0, routed)


def _width(linears: tuple[Linear, ...], hidden: int) -> int:
    """The intermediate width of an MLP (its down projection's input)."""
    return max((lin.d_in for lin in linears if lin.d_out == hidden), default=0)


def kind_mlp_bytes(
    kind: LayerKind, hidden: int, width: int, experts_trained: bool, model_type: str = ""
) -> float:
    """Bytes one token saves in the MLP block(s) of one layer kind: a dense MLP's four
    intermediate-wide tensors (gate, up, the activation, their product; two for a plain
    up/act/down MLP), and a MoE block as `moe_mlp_bytes` says."""
    out = 0.0
    if kind.mlp:
        inter = _width(kind.mlp, hidden)
        gated = len([lin for lin in kind.mlp if lin.d_in == hidden]) >= 2 or any(
            lin.d_out == 2 * inter for lin in kind.mlp)  # fmt: skip
        out += (4 if gated else 2) * inter * width
    e = kind.experts
    if e is not None:
        i = min(lin.d_in for lin in e.linears) if e.linears else 0
        ins = [lin for lin in e.linears if "down" not in lin.name.rsplit(".", 1)[-1]]
        gated = len(ins) >= 2 or any(lin.d_out == 2 * i for lin in ins)
        # SwiGLU experts save (4, 3) intermediate-wide tensors per slot, a plain up/act/down
        # expert (Nemotron-H's relu²) (2, 1).
        trained, frozen = GATE_TENSORS.get(model_type, (4, 3) if gated else (2, 1))
        wide = trained * i + 2 * hidden if experts_trained else frozen * i + hidden
        shared = 2 * sum(lin.d_out for lin in e.shared if "down" not in lin.name.rsplit(".", 1)[-1])
        out += e.top_k * (width * wide + ROUTED_INDEX_BYTES) + 4 * e.count + ROUTER_TOKEN_BYTES
        out += width * shared
    return out


def kind_mlp_temporaries(kind: LayerKind, hidden: int) -> int:
    """Elements per token of one layer kind's MLP backward temporaries beyond the hidden size."""
    out = 2 * _width(kind.mlp, hidden) if kind.mlp else 0
    e = kind.experts
    if e is not None and e.linears:
        out = max(out, e.top_k * (2 * min(lin.d_in for lin in e.linears) + hidden))
    return out
