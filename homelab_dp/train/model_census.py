"""A ModelSpec for any decoder transformers can build, from its module tree on the meta device.

``python -m homelab_dp.train.model_census DIR [--trust-remote-code] [--text-only]`` prints one
JSON line: the spec (`planning.model_spec.spec_to_dict`), or ``{"error": ..., "hint": ...}``
with exit code 2 for a model that cannot be planned. The front ends run it as a child process
(`app/model_specs.py`) so they never import torch; the worker may call `census` in-process.

How the tree is read: the decoder layers are the longest ``nn.ModuleList`` of one class; a
linear is a layer's ``nn.Linear`` present, with one shape, in every layer; 3-D parameters under
an ``experts`` module are fused routed experts (``[count, ...]``), a router is a 2-D
``[count, hidden]`` weight beside them; what else a layer holds counts as its norms (names with
"norm") or other parameters, and must be the same in every layer. Anything outside the layers,
the embeddings, the final norm and the head is a multimodal wrapper's vision part.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.pytorch_utils import Conv1D

from homelab_dp.errors import ModelSpecError
from homelab_dp.planning.model_spec import (
    ATTENTION_KINDS,
    DECODER_HINT,
    Experts,
    LayerGroup,
    LayerKind,
    Linear,
    Mixer,
    ModelSpec,
    hand_written_spec,
    read_config,
    spec_to_dict,
)

TOP_K_NAMES = (
    "num_experts_per_tok", "top_k_experts", "moe_topk", "top_k", "num_selected_experts", "moe_k",
)  # fmt: skip
UNEVEN_HINT = (
    "the planner describes a model by one decoder layer (and its MoE or dense variant); "
    "hybrid attention/state-space or per-layer-sized models are not planned yet"
)
AUX_NAMES = ("router_aux_loss_coef", "aux_loss_alpha", "router_aux_loss_factor")


def _numel(params: list[nn.Parameter]) -> int:
    return sum(p.numel() for p in params)


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
    globally counts as unset)."""
    for name in names:
        try:
            value = getattr(config, name, None)
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


def _layer_parts(layer: nn.Module, hidden: int) -> dict[str, Any]:
    """One decoder layer split into linears, routed experts, router, shared experts and rest."""
    linears: dict[str, Linear] = {}
    experts: list[Linear] = []
    expert_biases: dict[str, int] = {}
    count, fused = 0, True
    for mod_name, lin in _all_linears(layer).items():
        if ".experts." not in f".{mod_name}.":
            linears[mod_name] = lin
    for name, p in layer.named_parameters():
        if ".experts." in f".{name}" and "shared" not in name:
            if p.dim() == 3:
                count = int(p.shape[0])
                experts.append(_expert_linear(name, p.shape, hidden))
            elif p.dim() == 2:
                expert_biases[name] = int(p.shape[1])
    # Per-expert nn.Linear (unfused): experts.N.<linear>, counted by their distinct N.
    unfused = {n: lin for n, lin in _all_linears(layer).items() if ".experts." in f".{n}."}
    if unfused and not experts:
        ids = Counter(n.split("experts.")[1].split(".")[0] for n in unfused)
        count, fused = len(ids), False
        first = next(iter(ids))
        experts = [
            lin for n, lin in unfused.items() if n.split("experts.")[1].split(".")[0] == first
        ]
    for bias_name, width in expert_biases.items():  # fused biases join their linear
        for i, lin in enumerate(experts):
            if bias_name.startswith(lin.name) and lin.d_out == width and not lin.bias:
                experts[i] = Linear(lin.name, lin.d_in, lin.d_out, True)
                break
        else:
            raise ModelSpecError(f"expert bias {bias_name} matches no expert tensor", hint="")
    router = 0
    if count:
        for name, p in layer.named_parameters():
            if ".experts." in f".{name}" or "shared" in name:
                continue
            if (
                p.dim() == 2
                and tuple(p.shape) == (count, hidden)
                or (p.dim() == 1 and p.shape[0] == count and ("router" in name or "gate" in name))
            ):
                router += p.numel()
                linears.pop(name.rsplit(".", 1)[0], None)
    shared = {n: lin for n, lin in linears.items() if "shared" in n}
    shared_gate = sum(lin.params for n, lin in shared.items() if lin.d_out == 1)
    shared = {n: lin for n, lin in shared.items() if lin.d_out != 1}
    for n in [*shared, *(n for n, lin in linears.items() if "shared" in n)]:
        linears.pop(n, None)
    # The layer's own norms (direct children); a q/k norm inside attention counts as "other".
    norms = sum(p.numel() for n, p in layer.named_parameters() if _is_norm(n.split(".")[0]))
    total = _numel(list(layer.parameters()))
    return {
        "linears": linears, "experts": tuple(experts), "count": count, "router": router, "fused": fused,
        "shared": tuple(shared.values()), "shared_gate": shared_gate, "norms": norms, "total": total,
    }  # fmt: skip


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


def _same(values: list[int], what: str) -> int:
    if len(set(values)) != 1:
        raise ModelSpecError(
            f"the decoder layers differ in their {what} ({sorted(set(values))})",
            hint=UNEVEN_HINT,
        )
    return values[0]


def census(
    folder: str | Path, *, trust_remote_code: bool = False, text_only: bool = False
) -> ModelSpec:
    """Build the model of ``folder``'s config.json on the meta device and describe it."""
    source = str(Path(folder) / "config.json")
    raw = read_config(folder)  # regular, bounded, every size checked (`check_config_sizes`)
    model_type = raw.get("model_type")
    if model_type not in CONFIG_MAPPING and not (trust_remote_code and raw.get("auto_map")):
        raise ModelSpecError(
            f"{source}: model_type={model_type!r} is unknown to transformers "
            f"{transformers.__version__}",
            hint="upgrade transformers, or set model.trust_remote_code = true if the folder "
            "ships the model's code (auto_map) and you trust it",
        )
    config = transformers.AutoConfig.from_pretrained(
        str(folder), trust_remote_code=trust_remote_code, local_files_only=True
    )
    if getattr(config, "is_encoder_decoder", False):
        raise ModelSpecError(
            f"{source}: model_type={model_type!r} is an encoder-decoder (seq2seq) model",
            hint=DECODER_HINT,
        )
    if text_only:
        config = config.get_text_config()
    text = config.get_text_config()
    autos = [transformers.AutoModelForCausalLM]
    if config is not text:  # Mistral 3, Qwen2.5-VL: the wrapper is image-text-to-text
        autos.append(transformers.AutoModelForImageTextToText)
    for auto in autos:
        try:
            with torch.device("meta"):
                model = auto.from_config(config, trust_remote_code=trust_remote_code)
            break
        except ValueError as exc:
            if "Unrecognized configuration class" not in str(exc):
                raise
    else:
        raise ModelSpecError(
            f"{source}: model_type={model_type!r} is not a causal language model transformers "
            "can build (AutoModelForCausalLM)",
            hint=DECODER_HINT,
        )
    return describe(model, text, wrapper=config is not text, source=source)


def any_model_spec(
    folder: str | Path, *, trust_remote_code: bool = False, text_only: bool = False
) -> ModelSpec:
    """In-process: the hand-written spec where there is one, else the census."""
    spec = hand_written_spec(folder, trust_remote_code=trust_remote_code, text_only=text_only)
    if spec is not None:
        return spec
    return census(folder, trust_remote_code=trust_remote_code, text_only=text_only)


def describe(model: nn.Module, text: Any, *, wrapper: bool, source: str) -> ModelSpec:
    """The ModelSpec of a built model (any device) whose text config is ``text``; a
    ModelSpecError naming the file and model_type when the tree cannot be described.

    Every layer is described (`layer_kind`) and equal layers grouped. A model whose layers all
    hold one attention mixer of one shape gets the uniform form (no `ModelSpec.blocks`, exactly
    as before); any other (hybrids, dense and MoE layers of other shapes, per-layer sizes) gets
    its layer groups."""
    try:
        groups = layer_groups(model, text)
        uniform = all(
            len(g.kind.mixers) == 1 and g.kind.mixers[0].kind in ATTENTION_KINDS for g, _ in groups
        )
        if uniform:
            try:
                return _describe(model, text, wrapper=wrapper, source=source)
            except ModelSpecError:
                pass  # not one repeated layer: described by its groups
        return _describe_groups(model, text, groups, wrapper=wrapper, source=source)
    except ModelSpecError as exc:
        if exc.message.startswith(source):
            raise
        raise ModelSpecError(
            f"{source}: model_type={text.model_type!r}: {exc.message}", hint=exc.hint
        ) from None


def _describe(model: nn.Module, text: Any, *, wrapper: bool, source: str) -> ModelSpec:
    hidden = hidden_size(model, text)
    layers_name, layers = _decoder_layers(model)
    if not any(_is_attention(name) for name, _ in layers[0].named_modules()):
        raise ModelSpecError(
            f"{source}: model_type={text.model_type!r} is not a transformer decoder (its layers "
            "have no attention: a state-space or recurrent model)",
            hint="homelab-dp plans attention decoders (llama, qwen3, mistral, gemma3, ...); "
            "state-space and recurrent layers are not in its memory model",
        )
    parts = [_layer_parts(layer, hidden) for layer in layers]
    common = {
        n: lin
        for n, lin in parts[0]["linears"].items()
        if all(p["linears"].get(n) == lin for p in parts)
    }
    moe_parts = [p for p in parts if p["count"]]
    dense_parts = [p for p in parts if not p["count"]]
    experts, dense_mlp = None, ()
    if moe_parts:
        first = moe_parts[0]
        top_k = int(_attr(text, *TOP_K_NAMES, default=0))
        if not top_k:
            raise ModelSpecError(
                f"{source}: a Mixture-of-Experts model without num_experts_per_tok",
                hint="config.json must say how many experts each token uses",
            )
        experts = Experts(
            count=first["count"], top_k=top_k, linears=first["experts"], layers=len(moe_parts),
            fused=first["fused"],
            router_params=first["router"], shared=first["shared"], shared_gate_params=first["shared_gate"],
            aux_loss_coef=float(_attr(text, *AUX_NAMES, default=0.0)),
        )  # fmt: skip
        if dense_parts:
            dense_mlp = tuple(
                lin for n, lin in dense_parts[0]["linears"].items() if n not in common
            )
    linear_params = sum(lin.params for lin in common.values())
    norms = _same([p["norms"] for p in parts], "norms")
    dense_params = sum(lin.params for lin in dense_mlp)
    moe_params = experts.layer_params if experts else 0
    other = _same(
        [
            p["total"] - linear_params - norms - (moe_params if p["count"] else dense_params)
            for p in parts
        ],
        "parameters outside linears and norms",
    )
    layer_ids = {id(p) for p in layers.parameters()}
    inputs, outputs = model.get_input_embeddings(), model.get_output_embeddings()
    tied = outputs is not None and outputs.weight is inputs.weight
    head = 0 if tied or outputs is None else _numel(list(outputs.parameters()))
    head_ids = set() if outputs is None else {id(p) for p in outputs.parameters()}
    # Embeddings: every nn.Embedding beside the layers (tokens, and positions for GPT-2 likes).
    parent = model.get_submodule(layers_name.rsplit(".", 1)[0]) if "." in layers_name else model
    embed = {
        id(p): p for m in parent.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    embed = {k: p for k, p in embed.items() if k not in layer_ids}
    rest = [
        p
        for p in parent.parameters()
        if id(p) not in layer_ids and id(p) not in embed and id(p) not in head_ids
    ]
    final_norm = _numel(rest)
    total = _numel(list(model.parameters()))
    embedding = _numel(list(embed.values()))
    vision = total - embedding - head - final_norm - sum(p["total"] for p in parts)
    if vision and not wrapper:
        final_norm += vision  # parameters at the top of a plain decoder (none in common families)
        vision = 0
    heads = int(_attr(text, "num_attention_heads", default=1))
    head_dim = int(_attr(text, "head_dim", default=hidden // heads))
    window = int(_attr(text, "sliding_window", default=0) or 0)
    types = list(getattr(text, "layer_types", None) or [])
    sliding = (
        sum(1 for t in types if t == "sliding_attention")
        if types
        else (len(parts) if window else 0)
    )
    quant = getattr(text, "quantization_config", None) or getattr(
        model.config, "quantization_config", None
    )
    if isinstance(quant, dict):
        quant = quant.get("quant_method")
    softcap = _attr(text, "final_logit_softcapping", "logit_softcapping")
    scale = _attr(text, "logits_scaling", "logit_scale", default=1.0)
    return ModelSpec(
        model_type=str(text.model_type if not wrapper else model.config.model_type),
        layers=len(parts), hidden=hidden, heads=heads,
        kv_heads=int(_attr(text, "num_key_value_heads", default=heads)), head_dim=head_dim,
        intermediate=int(_attr(text, "moe_intermediate_size", "intermediate_size", default=4 * hidden)
                         if experts else _attr(text, "intermediate_size", "n_inner", default=4 * hidden) or 4 * hidden),
        vocab=_vocab(model, text), max_positions=int(_attr(text, "max_position_embeddings", default=0)),
        tied_embeddings=tied, linears=tuple(common.values()), embedding_params=embedding,
        lm_head_params=head, norm_params_per_layer=norms, final_norm_params=final_norm,
        other_params_per_layer=other, source="meta-device",
        attention_dropout=float(_attr(text, "attention_dropout", default=0.0) or 0.0),
        experts=experts, dense_mlp=dense_mlp, sliding_window=window if sliding else 0,
        sliding_layers=sliding if window else 0, vision_params=vision,
        quantization=None if quant is None else str(quant),
        full_logits=softcap is not None or float(scale or 1.0) != 1.0,
    )  # fmt: skip


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
        ids = Counter(n.split("experts.")[1].split(".")[0] for n in unfused)
        count, fused = len(ids), False
        first = next(iter(ids))
        experts = [
            lin for n, lin in unfused.items() if n.split("experts.")[1].split(".")[0] == first
        ]
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
        if not linears and _is_norm(child_name) or "norm" in type(child).__name__.lower():
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


def _describe_groups(
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
    quant = _attr(text, "quantization_config") or _get(model.config, "quantization_config")
    if isinstance(quant, dict):
        quant = quant.get("quant_method")
    softcap = _attr(text, "final_logit_softcapping", "logit_softcapping")
    scale = _attr(text, "logits_scaling", "logit_scale", default=1.0)
    return ModelSpec(
        model_type=str(text.model_type if not wrapper else model.config.model_type),
        layers=len(layers), hidden=hidden, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
        intermediate=intermediate, vocab=_vocab(model, text),
        max_positions=int(_attr(text, "max_position_embeddings", default=0) or 0),
        tied_embeddings=tied, linears=tuple(distinct.values()), embedding_params=embedding,
        lm_head_params=head, norm_params_per_layer=0, final_norm_params=final_norm,
        other_params_per_layer=0, source="meta-device",
        attention_dropout=float(_attr(text, "attention_dropout", default=0.0) or 0.0),
        experts=experts, dense_mlp=dense_mlp, sliding_window=window if sliding else 0,
        sliding_layers=sliding if window else 0, vision_params=vision,
        quantization=None if quant is None else str(quant),
        full_logits=softcap is not None or float(scale or 1.0) != 1.0,
        blocks=blocks, extras=out_extras,
    )  # fmt: skip


def main(argv: list[str]) -> int:
    """Print the census of ``argv[0]`` as one JSON line (exit 0), or the refusal (exit 2)."""
    folder = argv[0]
    try:
        spec = census(
            folder, trust_remote_code="--trust-remote-code" in argv, text_only="--text-only" in argv
        )
    except ModelSpecError as exc:
        print(json.dumps({"error": exc.message, "hint": exc.hint}))
        return 2
    except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
        # transformers' own refusal of the config: a missing or inconsistent field.
        source = Path(folder) / "config.json"
        try:
            model_type = json.loads(source.read_text(encoding="utf-8")).get("model_type")
        except (OSError, ValueError, AttributeError):
            model_type = None
        message = f"{source}: transformers cannot build model_type={model_type!r} from it: {exc}"
        hint = "check config.json against the model's published one"
        print(json.dumps({"error": " ".join(message.split()), "hint": hint}))
        return 2
    out = spec_to_dict(spec)
    out["transformers"] = transformers.__version__
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
