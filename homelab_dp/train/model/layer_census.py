"""The census's reading of a decoder's module tree, layer by layer (issue 36): each layer's token
mixer(s) (attention of every kind, Gated DeltaNet, Mamba, short convolution, other recurrent
mixers), its dense MLP or MoE block (routed experts, router, shared experts) and its norms,
then equal layers grouped (`layer_groups`) and the whole model described by its groups
(`describe_groups`, a `ModelSpec` with `blocks`). Parameters several layers share (Zamba's
shared block) are counted once, outside the layers. `train.model.model_census` runs it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

from homelab_dp.errors import ModelSpecError
from homelab_dp.planning.model_layers import nf4_keeps_16bit
from homelab_dp.planning.model_spec import (
    ATTENTION_KINDS,
    DECODER_HINT,
    Experts,
    LayerGroup,
    LayerKind,
    Linear,
    Mixer,
    ModelSpec,
)

TOP_K_NAMES = (
    "num_experts_per_tok", "top_k_experts", "moe_topk", "top_k", "num_selected_experts", "moe_k",
    "moe_top_k",
)  # fmt: skip
UNEVEN_HINT = (
    "the planner describes a model by one decoder layer (and its MoE or dense variant); "
    "hybrid attention/state-space or per-layer-sized models are not planned yet"
)
AUX_NAMES = ("router_aux_loss_coef", "aux_loss_alpha", "router_aux_loss_factor", "moe_loss_weight")
SUB_CONFIGS = ("ffn_config",)
"""Sub-configs that hold a family's MoE settings (DBRX's ``ffn_config.moe_top_k`` and
``moe_loss_weight``), read by `_attr` where the config itself does not set a name."""


def _numel(params: list[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


def outer_quantized(model: nn.Module, layers: nn.ModuleList) -> int:
    """The weights QLoRA quantizes outside the decoder layers: every module bitsandbytes
    converts (exactly ``nn.Linear``, or GPT-2's ``Conv1D``, as transformers'
    ``replace_with_bnb_linear`` picks them) that is not the output layer, not in a decoder
    layer and not kept 16-bit by `model_layers.nf4_skip_modules` (matched on its full name,
    as the worker's load matches it): Gemma 4's ``per_layer_model_projection``, a vision
    tower's linears."""
    model_type = str(getattr(model.config, "model_type", ""))
    inside = {id(m) for m in layers.modules()}
    head = model.get_output_embeddings()
    total = 0
    for name, module in model.named_modules():
        if id(module) in inside or module is head:
            continue
        converted = type(module) is nn.Linear or isinstance(module, Conv1D)
        if converted and not nf4_keeps_16bit(model_type, name):
            total += module.weight.numel()
    return total


def _decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder layers: the longest ``nn.ModuleList`` outside a vision tower (its items may
    be of several classes: Jamba's attention and Mamba layers)."""
    best: tuple[str, nn.ModuleList] | None = None
    for name, module in model.named_modules():
        if (
            isinstance(module, nn.ModuleList)
            and len(module) > 0
            and "vision" not in name
            and "visual" not in name
            and (best is None or len(module) > len(best[1]))
        ):
            best = (name, module)
    if best is None:
        raise ModelSpecError("it has no list of decoder layers", hint=DECODER_HINT)
    return best


def _attr(config: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` the config sets (a per-layer attribute Gemma 4 refuses to give
    globally counts as unset), else the first a sub-config of `SUB_CONFIGS` sets."""
    subs = [getattr(config, s, None) for s in SUB_CONFIGS]
    for holder in (config, *(s for s in subs if s is not None and not isinstance(s, dict))):
        for name in names:
            try:
                value = getattr(holder, name, None)
            except Exception:  # noqa: BLE001 - transformers' AmbiguousGlobalPerLayerAttributeError
                value = None
            if value is not None:
                return value
    return default


def _expert_linear(name: str, shape: torch.Size, hidden: int) -> Linear:
    """A fused expert tensor ``[count, a, b]`` as one expert's 2-D linear (down: out = hidden)."""
    a, b = int(shape[1]), int(shape[2])
    other = b if a == hidden else a
    if "down" in name.split(".")[-1]:
        return Linear(name, other, hidden)
    return Linear(name, hidden, other)


def _all_linears(layer: nn.Module) -> dict[str, Linear]:
    """The layer's nn.Linear and transformers' Conv1D (GPT-2's linears, weight [in, out])."""
    found = {}
    for n, m in layer.named_modules():
        if isinstance(m, nn.Linear):
            found[n] = Linear(n, m.in_features, m.out_features, m.bias is not None)
        elif isinstance(m, Conv1D):
            found[n] = Linear(n, int(m.weight.shape[0]), int(m.weight.shape[1]), m.bias is not None)
    return found


def _is_attention(name: str) -> bool:
    last = name.rsplit(".", 1)[-1].lower()
    return "attn" in last or "attention" in last


def _is_norm(child: str) -> bool:
    return "norm" in child.lower() or child.startswith("ln")


# --- Layer groups: every decoder layer by its kind (issue 36) ---------------------------------

MLP_WORDS = ("mlp", "feed_forward", "feedforward", "ffn", "ff")


def _get(module: Any, name: str) -> Any:
    try:
        return getattr(module, name, None)
    except Exception:  # noqa: BLE001 - a per-layer config attribute read globally
        return None


def _int_attr(module: Any, *names: str, default: int = 0) -> int:
    for name in names:
        value = _get(module, name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return default


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def _prefixed(prefix: str, module: nn.Module) -> dict[str, Linear]:
    return {
        _join(prefix, n): replace_name(lin, _join(prefix, n))
        for n, lin in _all_linears(module).items()
    }


def replace_name(lin: Linear, name: str) -> Linear:
    """``lin`` under another name."""
    return Linear(name, lin.d_in, lin.d_out, lin.bias)


def _mixer_kind(child_name: str, module: nn.Module) -> str | None:
    """The `MIXER_KINDS` kind of a decoder layer's child, None for a child that mixes no tokens."""
    cls = type(module).__name__.lower()
    if "mlp" in cls or any(w in child_name.lower() for w in ("mlp", "ffn", "feed_forward")):
        return None  # an MLP, whatever its class says (RecurrentGemmaMlp)
    if "residual" in cls or "hyper_connection" in child_name.lower():
        return None  # a residual's gate named after its branch (Qwen4-Exp's attn_hyper_connection)
    names = {n.rsplit(".", 1)[-1] for n, _ in module.named_parameters()}
    a_log = next((p for n, p in module.named_parameters() if n.endswith("A_log")), None)
    if "deltanet" in cls or "gated_delta" in cls:
        return "linear_attention"
    if a_log is not None:
        return "mamba2" if a_log.dim() == 1 else "mamba"
    if "shortconv" in cls or "short_conv" in cls:
        return "short_conv"
    if (_is_attention(child_name) or "attention" in cls or "attn" in cls) and len(
        _all_linears(module)
    ) >= 2:  # projections in and out (a residual gate named after attention is none)
        if names & {"time_decay", "time_first", "time_faaaa"}:
            return "recurrent"
        return "attention"
    if names & {"time_decay", "time_first", "recurrent_param"} or any(
        w in cls for w in ("recurrent", "lru", "rwkv", "lstm", "retention")
    ):
        return "recurrent"
    return None


def _attention_mixer(prefix: str, module: nn.Module, text: Any, index: int, hidden: int) -> Mixer:
    linears = _prefixed(prefix, module)
    rest = _numel(list(module.parameters())) - sum(lin.params for lin in linears.values())
    last = {n.rsplit(".", 1)[-1]: lin for n, lin in linears.items()}
    layer_types = _attr(text, "layer_types", default=None) or []
    layer_type = layer_types[index] if index < len(layer_types) else "full_attention"
    head_dim = _int_attr(module, "head_dim") or _int_attr(text, "head_dim")
    heads_cfg = _int_attr(text, "num_attention_heads", default=1) or 1
    head_dim = head_dim or max(1, hidden // heads_cfg)
    out = last.get("o_proj") or last.get("out_proj") or last.get("dense") or last.get("c_proj")
    heads = max(1, out.d_in // head_dim) if out else heads_cfg
    k = last.get("k_proj") or last.get("v_proj")
    kv_heads = max(1, k.d_out // head_dim) if k else 0  # 0: keys and values of another layer
    q = last.get("q_proj")
    if any(n in last for n in ("kv_a_proj_with_mqa", "q_a_proj", "kv_a_proj")):
        kind = "mla"
    elif q is not None and out is not None and q.d_out == 2 * out.d_in:
        kind = "gated_attention"  # q_proj also makes the output gate (Qwen3-Next, Qwen3.5)
    elif layer_type == "sliding_attention":
        kind = "sliding_attention"
    elif layer_type == "chunked_attention":
        kind = "chunked_attention"
    else:
        kind = "attention"
    window = 0
    if kind == "sliding_attention":
        window = _int_attr(text, "sliding_window")
    elif kind == "chunked_attention":
        window = _int_attr(text, "attention_chunk_size", "chunk_size")
    if q is None and "qkv_proj" not in last and "c_attn" not in last and not k:
        kv_heads = heads  # a fused projection under another name: as many KV heads as heads
    dims = (("heads", heads), ("kv_heads", kv_heads), ("head_dim", head_dim), ("window", window))
    return Mixer(kind, tuple(linears.values()), rest, dims)


def _state_mixer(kind: str, prefix: str, module: nn.Module, hidden: int) -> Mixer:
    linears = _prefixed(prefix, module)
    rest = _numel(list(module.parameters())) - sum(lin.params for lin in linears.values())
    conv = _int_attr(module, "conv_kernel_size", "d_conv", "L_cache", default=4)
    if kind == "linear_attention":
        dims = (("k_heads", _int_attr(module, "num_k_heads", default=1)),
                ("v_heads", _int_attr(module, "num_v_heads", default=1)),
                ("k_dim", _int_attr(module, "head_k_dim", default=1)),
                ("v_dim", _int_attr(module, "head_v_dim", default=1)), ("conv_kernel", conv))  # fmt: skip
    elif kind in ("mamba2", "mamba"):
        inner = _int_attr(module, "intermediate_size", "d_inner", "ssm_intermediate_size")
        heads = _int_attr(module, "num_heads", default=1)
        dims = (("heads", heads), ("head_dim", _int_attr(module, "head_dim", default=inner // max(1, heads))),
                ("state", _int_attr(module, "ssm_state_size", "d_state", default=16)),
                ("groups", _int_attr(module, "n_groups", default=1)), ("conv_kernel", conv),
                ("inner", inner), ("chunk", _int_attr(module, "chunk_size", default=256)))  # fmt: skip
    else:
        dims = (("conv_kernel", conv), ("width", hidden))
    return Mixer(kind, tuple(linears.values()), rest, dims)


def _moe_block(prefix: str, module: nn.Module, hidden: int, top_k: int, aux: float) -> Experts:
    """The routed experts (fused 3-D or one nn.Linear each), router and shared experts of a
    MoE block (a child of the decoder layer holding an ``experts`` module)."""
    experts: list[Linear] = []
    biases: dict[str, int] = {}
    count, fused = 0, True
    expert_ids: set[int] = set()
    for name, p in module.named_parameters():
        full = _join(prefix, name)
        if ".experts." in f".{name}" and "shared" not in name:
            expert_ids.add(id(p))
            if p.dim() == 3:
                count = int(p.shape[0])
                experts.append(_expert_linear(full, p.shape, hidden))
            elif p.dim() == 2:
                biases[full] = int(p.shape[1])
    linears = _prefixed(prefix, module)
    unfused = {
        n: lin for n, lin in linears.items() if ".experts." in f".{n}." and "shared" not in n
    }
    if unfused and not experts:
        (count, experts), fused = unfused_experts(unfused), False
    stacked = _stacked_2d(module, biases, hidden) if not experts and not unfused else None
    if stacked is not None:  # DBRX: each expert's rows stacked in a 2-D parameter
        count, experts = stacked
        biases = {}
    for bias_name, width in biases.items():
        for i, lin in enumerate(experts):
            if bias_name.startswith(lin.name) and lin.d_out == width and not lin.bias:
                experts[i] = Linear(lin.name, lin.d_in, lin.d_out, True)
                break
        else:  # a per-expert vector of its own (a norm's weight): one row per expert
            experts.append(Linear(bias_name, 1, width))
    if not count:
        raise ModelSpecError("a MoE block without experts", hint=DECODER_HINT)
    shared_all = {n: lin for n, lin in linears.items() if "shared" in n and n not in unfused}
    shared = tuple(lin for lin in shared_all.values() if lin.d_out != 1)
    shared_gate = sum(lin.params for lin in shared_all.values() if lin.d_out == 1)
    shared_ids = {
        id(p) for n, p in module.named_parameters() if "shared" in n and ".experts." not in f".{n}"
    }
    total = _numel(list(module.parameters()))
    expert_params = sum(p.numel() for p in module.parameters() if id(p) in expert_ids)
    shared_params = sum(p.numel() for p in module.parameters() if id(p) in shared_ids)
    router = total - expert_params - shared_params  # the router, its bias and score correction
    if shared_params != sum(lin.params for lin in shared) + shared_gate:
        router += shared_params - sum(lin.params for lin in shared) - shared_gate
    if top_k > count:
        raise ModelSpecError(
            f"top-k {top_k} is above the {count} experts", hint="num_experts_per_tok <= num_experts"
        )
    return Experts(
        count=count, top_k=top_k, linears=tuple(experts), layers=0, fused=fused,
        router_params=router, shared=shared, shared_gate_params=shared_gate, aux_loss_coef=aux,
    )  # fmt: skip


def unfused_experts(unfused: dict[str, Linear]) -> tuple[int, list[Linear]]:
    """Per-expert nn.Linear modules (``experts.N.<linear>``, name → linear): the number of
    experts (their distinct N) and the first expert's linears."""
    ids = Counter(n.split("experts.")[1].split(".")[0] for n in unfused)
    first = next(iter(ids))
    return len(ids), [
        lin for n, lin in unfused.items() if n.split("experts.")[1].split(".")[0] == first
    ]


def _stacked_2d(
    module: nn.Module, params: dict[str, int], hidden: int
) -> tuple[int, list[Linear]] | None:
    """Routed experts stored as 2-D parameters ``[count × width, hidden]`` (DBRX's ``w1``,
    ``v1``, ``w2``), the count from the experts module's ``num_experts``: (count, one expert's
    linears), or None where the block's experts are not stored so."""
    found = [m for n, m in module.named_modules() if n.rsplit(".", 1)[-1] == "experts"]
    count = int(getattr(found[0], "num_experts", 0) or 0) if found else 0
    shapes = {n: tuple(p.shape) for n, p in module.named_parameters() if ".experts." in f".{n}"}
    if not count or not params:
        return None
    out: list[Linear] = []
    for name in params:
        rel = name.split(".experts.", 1)[-1] if ".experts." in name else name
        shape = next((v for k, v in shapes.items() if name.endswith(k) or k.endswith(rel)), None)
        if shape is None or shape[1] != hidden or shape[0] % count:
            return None
        width = shape[0] // count
        down = name.rsplit(".", 1)[-1] in ("w2", "down_proj")
        out.append(Linear(name, width, hidden) if down else Linear(name, hidden, width))
    return count, out


def layer_kind(
    layer: nn.Module,
    text: Any,
    index: int,
    hidden: int,
    shared: set[int] | frozenset[int] = frozenset(),
) -> LayerKind:
    """One decoder layer described by its children: norms, token mixer(s), MLP or MoE block.

    A child whose parameters other layers hold too (``shared``) adds no parameters here: a
    mixer among them is kept for its activations and FLOPs, without linears."""
    mixers: list[Mixer] = []
    mlp: list[Linear] = []
    other_linears: list[Linear] = []
    experts = None
    norms = other = 0
    top_k = int(_attr(text, *TOP_K_NAMES, default=0) or 0)
    aux = float(_attr(text, *AUX_NAMES, default=0.0) or 0.0)
    children = dict(layer.named_children())
    if "experts" in children:  # the experts and their router straight in the layer (Gemma 4)
        if not top_k:
            raise ModelSpecError(
                "a Mixture-of-Experts model without num_experts_per_tok (or top_k_experts)",
                hint="config.json must say how many experts each token uses",
            )
        box = nn.Module()
        for name in ("experts", "router", "gate"):
            if name in children:
                box.add_module(name, children.pop(name))
        experts = _moe_block("", box, hidden, top_k, aux)
    for child_name, child in children.items():
        total = _numel(list(child.parameters()))
        if not total:
            continue
        if all(id(p) in shared for p in child.parameters()):
            for sub_name, sub in [(child_name, child), *child.named_children()]:
                kind = _mixer_kind(sub_name, sub)
                if kind == "attention":
                    m = _attention_mixer(sub_name, sub, text, index, hidden)
                    mixers.append(Mixer(m.kind, (), 0, m.dims))
                    break
                if kind is not None:
                    m = _state_mixer(kind, sub_name, sub, hidden)
                    mixers.append(Mixer(m.kind, (), 0, m.dims))
                    break
            continue
        names = [n for n, _ in child.named_parameters()]
        mixer_first = _mixer_kind(child_name, child) is not None and _is_attention(child_name)
        if any(".experts." in f".{n}" for n in names) and not mixer_first:
            if not top_k:
                raise ModelSpecError(
                    "a Mixture-of-Experts model without num_experts_per_tok",
                    hint="config.json must say how many experts each token uses",
                )
            experts = _moe_block(child_name, child, hidden, top_k, aux)
            continue
        linears = _prefixed(child_name, child)
        norm_like = (not linears and _is_norm(child_name)) or "norm" in type(child).__name__.lower()
        holds_attention = any(_is_attention(n) for n, _ in child.named_children())
        if norm_like and not holds_attention:  # DBRX's norm_attn_norm holds the attention
            norms += total
            continue
        kind = _mixer_kind(child_name, child)
        if kind is not None and kind != "attention":
            mixers.append(_state_mixer(kind, child_name, child, hidden))
        elif kind == "attention":
            mixers.append(_attention_mixer(child_name, child, text, index, hidden))
        elif (
            any(w in child_name.lower() for w in MLP_WORDS) or "mlp" in type(child).__name__.lower()
        ):
            mlp += linears.values()
            other += total - sum(lin.params for lin in linears.values())
        else:
            other_linears += linears.values()
            other += total - sum(lin.params for lin in linears.values())
    other += sum(p.numel() for _, p in layer.named_parameters(recurse=False))
    mixers.sort(key=lambda m: m.kind not in ATTENTION_KINDS)  # "attention+mamba2"
    return LayerKind(
        mixers=tuple(mixers), mlp=tuple(mlp), experts=experts, norm_params=norms,
        other_linears=tuple(other_linears), other_params=other,
    )  # fmt: skip


def hidden_size(model: nn.Module, text: Any) -> int:
    """The model's width: the config's, else the token embedding's (BLT names it otherwise)."""
    value = _attr(text, "hidden_size", "n_embd", "d_model", "dim")
    if isinstance(value, int) and value > 0:
        return value
    inputs = model.get_input_embeddings()
    if isinstance(inputs, nn.Embedding):
        return int(inputs.embedding_dim)
    raise ModelSpecError("its config names no hidden size", hint=DECODER_HINT)


def _vocab(model: nn.Module, text: Any) -> int:
    value = _attr(text, "vocab_size")
    if isinstance(value, int) and value > 0:
        return value
    inputs = model.get_input_embeddings()
    return int(inputs.num_embeddings) if isinstance(inputs, nn.Embedding) else 1


def layer_groups(model: nn.Module, text: Any) -> list[tuple[LayerGroup, list[int]]]:
    """The decoder layers grouped by kind, in the order each kind first appears, with the
    indices of its layers."""
    hidden = hidden_size(model, text)
    _, layers = _decoder_layers(model)
    shared = shared_across_layers(layers)
    seen: dict[LayerKind, list[int]] = {}
    for i, layer in enumerate(layers):
        seen.setdefault(layer_kind(layer, text, i, hidden, shared), []).append(i)
    return [(LayerGroup(kind, len(ids)), ids) for kind, ids in seen.items()]


def shared_across_layers(layers: nn.ModuleList) -> set[int]:
    """Ids of the parameters that more than one decoder layer holds (Zamba's shared attention
    block): counted once, outside the layers (``extras`` "shared_blocks")."""
    owners: Counter[int] = Counter()
    for layer in layers:
        owners.update({id(p) for p in layer.parameters()})
    return {k for k, n in owners.items() if n > 1}


def describe_groups(
    model: nn.Module, text: Any, groups: list[tuple[LayerGroup, list[int]]], *, wrapper: bool,
    source: str,
) -> ModelSpec:  # fmt: skip
    """The spec of a model whose layers are not one repeated attention layer (`ModelSpec.blocks`)."""
    hidden = hidden_size(model, text)
    layers_name, layers = _decoder_layers(model)
    blocks = tuple(g for g, _ in groups)
    if not any(g.kind.mixers for g in blocks):
        raise ModelSpecError(
            "its layers mix no tokens (no attention, state-space or recurrent layer)",
            hint=DECODER_HINT,
        )
    layer_ids = {id(p) for p in layers.parameters()}
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    tied = outputs is not None and inputs is not None and outputs.weight is inputs.weight
    head_ids = set() if outputs is None else {id(p) for p in outputs.parameters()}
    parent = model.get_submodule(layers_name.rsplit(".", 1)[0]) if "." in layers_name else model
    token_ids = set() if inputs is None else {id(p) for p in inputs.parameters()}
    # lm_head's own parameters (a tied head's bias too)
    head = (
        0
        if outputs is None
        else _numel([p for p in outputs.parameters() if id(p) not in token_ids])
    )
    embedding = 0 if inputs is None else _numel(list(inputs.parameters()))
    extras: dict[str, int] = {}
    shared = shared_across_layers(layers)
    if shared:  # a block several layers run (Zamba): its parameters once
        extras["shared_blocks"] = _numel([p for p in layers.parameters() if id(p) in shared])
    final_norm = 0
    counted = layer_ids | head_ids | token_ids
    for name, module in parent.named_children():
        params = [p for p in module.parameters() if id(p) not in counted]
        if not params or name == layers_name.rsplit(".", 1)[-1]:
            continue
        counted |= {id(p) for p in params}
        n = _numel(params)
        if "per_layer" in name:
            extras["per_layer_inputs"] = extras.get("per_layer_inputs", 0) + n
        elif isinstance(module, nn.Embedding):
            embedding += n  # position embeddings
        elif _is_norm(name) and not _all_linears(module):
            final_norm += n
        else:
            extras["outside_layers"] = extras.get("outside_layers", 0) + n
    direct = [p for p in parent.parameters(recurse=False) if id(p) not in counted]
    if direct:
        extras["outside_layers"] = extras.get("outside_layers", 0) + _numel(direct)
        counted |= {id(p) for p in direct}
    total = _numel(list(model.parameters()))
    vision = total - _numel([p for p in model.parameters() if id(p) in counted])
    if vision and not wrapper:
        extras["outside_layers"] = extras.get("outside_layers", 0) + vision
        vision = 0
    mtp = int(_attr(text, "num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers",
                    default=0) or 0)  # fmt: skip
    out_extras = tuple((k, v) for k, v in extras.items() if v)
    if mtp:
        out_extras += (("mtp_layers_not_built", mtp),)
    attn = next((m for g in blocks for m in g.kind.mixers if m.kind in ATTENTION_KINDS), None)
    heads_cfg = int(_attr(text, "num_attention_heads", default=1) or 1)
    heads = attn.dim("heads", heads_cfg) if attn else heads_cfg
    kv_heads = attn.dim("kv_heads", heads) if attn else heads
    head_dim = attn.dim("head_dim", 1) if attn else max(1, hidden // heads)
    moe = [g for g in blocks if g.kind.experts is not None]
    dense = [g for g in blocks if g.kind.experts is None and g.kind.mlp]
    experts = None
    if moe:
        first = moe[0].kind.experts
        assert first is not None
        experts = Experts(**{**first.__dict__, "layers": sum(g.count for g in moe)})
    dense_mlp = dense[0].kind.mlp if dense and moe else ()
    widths = [lin.d_in for g in dense for lin in g.kind.mlp if lin.d_out == hidden]
    if experts is not None:
        intermediate = min(lin.d_in for lin in experts.linears if lin.d_out == hidden) if any(
            lin.d_out == hidden for lin in experts.linears) else 0  # fmt: skip
    else:
        intermediate = widths[0] if widths else 0
    distinct: dict[str, Linear] = {}
    for g in blocks:
        for lin in g.kind.linears:
            distinct.setdefault(f"{lin.name}:{lin.d_in}x{lin.d_out}", lin)
    sliding = sum(
        g.count for g in blocks if any(m.kind == "sliding_attention" for m in g.kind.mixers)
    )
    window = int(_attr(text, "sliding_window", default=0) or 0) if sliding else 0
    return ModelSpec(
        **config_fields(model, text, wrapper=wrapper),
        layers=len(layers), hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=intermediate, tied_embeddings=tied, linears=tuple(distinct.values()),
        embedding_params=embedding, lm_head_params=head, norm_params_per_layer=0,
        final_norm_params=final_norm, other_params_per_layer=0, experts=experts,
        dense_mlp=dense_mlp, sliding_window=window if sliding else 0,
        sliding_layers=sliding if window else 0, vision_params=vision,
        blocks=blocks, extras=out_extras, outer_quantized=outer_quantized(model, layers),
    )  # fmt: skip


def config_fields(model: nn.Module, text: Any, *, wrapper: bool) -> dict[str, Any]:
    """The `ModelSpec` fields a census reads from the config alone, the same for both
    censuses: the model type (a multimodal wrapper's own), vocabulary, positions, attention
    dropout, the checkpoint's quantization method, and whether the logits are needed in full
    (a soft cap or a scale on them)."""
    quant = _attr(text, "quantization_config") or _get(model.config, "quantization_config")
    if isinstance(quant, dict):
        quant = quant.get("quant_method")
    softcap = _attr(text, "final_logit_softcapping", "logit_softcapping")
    scale = _attr(text, "logits_scaling", "logit_scale", default=1.0)
    return {
        "model_type": str(text.model_type if not wrapper else model.config.model_type),
        "vocab": _vocab(model, text),
        "max_positions": int(_attr(text, "max_position_embeddings", default=0) or 0),
        "source": "meta-device",
        "attention_dropout": float(_attr(text, "attention_dropout", default=0.0) or 0.0),
        "quantization": None if quant is None else str(quant),
        "full_logits": softcap is not None or float(scale or 1.0) != 1.0,
    }
