"""A ModelSpec for any decoder transformers can build, from its module tree on the meta device.

``python -m homelab_dp.train.model.model_census DIR [--trust-remote-code] [--text-only]`` prints one
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
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from homelab_dp.errors import ModelSpecError
from homelab_dp.planning.model_spec import (
    ATTENTION_KINDS,
    DECODER_HINT,
    Experts,
    Linear,
    ModelSpec,
    hand_written_spec,
    read_config,
    spec_to_dict,
)
from homelab_dp.train.model.layer_census import (
    AUX_NAMES,
    TOP_K_NAMES,
    UNEVEN_HINT,
    _all_linears,
    _attr,
    _decoder_layers,
    _expert_linear,
    _is_attention,
    _is_norm,
    _numel,
    config_fields,
    describe_groups,
    hidden_size,
    layer_groups,
    outer_quantized,
    unfused_experts,
)


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
        (count, experts), fused = unfused_experts(unfused), False
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
        return describe_groups(model, text, groups, wrapper=wrapper, source=source)
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
    return ModelSpec(
        **config_fields(model, text, wrapper=wrapper),
        layers=len(parts), hidden=hidden, heads=heads,
        kv_heads=int(_attr(text, "num_key_value_heads", default=heads)), head_dim=head_dim,
        intermediate=int(_attr(text, "moe_intermediate_size", "intermediate_size", default=4 * hidden)
                         if experts else _attr(text, "intermediate_size", "n_inner", default=4 * hidden) or 4 * hidden),
        tied_embeddings=tied, linears=tuple(common.values()), embedding_params=embedding,
        lm_head_params=head, norm_params_per_layer=norms, final_norm_params=final_norm,
        other_params_per_layer=other, experts=experts, dense_mlp=dense_mlp,
        sliding_window=window if sliding else 0, sliding_layers=sliding if window else 0,
        vision_params=vision, outer_quantized=outer_quantized(model, layers),
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
    except ImportError as exc:  # a library the family's modules need (Gemma 3n's timm)
        source = Path(folder) / "config.json"
        message = f"{source}: transformers needs a library it cannot import to build it: {exc}"
        hint = "install the library it names, or set model.text_only = true for a multimodal model"
        print(json.dumps({"error": " ".join(message.split()), "hint": hint,
                          "missing_library": True}))  # fmt: skip
        return 2
    out = spec_to_dict(spec)
    out["transformers"] = transformers.__version__
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
