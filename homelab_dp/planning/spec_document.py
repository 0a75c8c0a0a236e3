"""A ModelSpec read back from JSON (the census child's answer, the model-spec cache): every field
checked for its type and range and the counts for being positive; anything else is refused
(`ModelSpecError`), so a damaged or edited cache entry is derived again, never believed."""

from __future__ import annotations

from dataclasses import MISSING, fields
from typing import Any

from homelab_dp.errors import ModelSpecError
from homelab_dp.planning.model_config import MAX_LAYERS, MAX_SIZE
from homelab_dp.planning.model_layers import (
    MIXER_KINDS,
    Experts,
    LayerGroup,
    LayerKind,
    Linear,
    Mixer,
)
from homelab_dp.planning.model_spec import ModelSpec

_SPEC_INT_MIN = {"layers": 1, "hidden": 1, "heads": 1, "kv_heads": 1, "head_dim": 1,
                 "intermediate": 0, "vocab": 1}  # fmt: skip


def _bad_spec(why: str) -> ModelSpecError:
    return ModelSpecError(
        f"not a model spec ({why})", hint="delete the cached spec; it is derived again"
    )


def _int(value: Any, what: str, low: int = 0, high: int = MAX_SIZE) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        raise _bad_spec(f"{what} must be an integer in [{low}, {high}], got {str(value)[:40]!r}")
    return value


def _obj(value: Any, what: str, keys: set[str], required: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _bad_spec(f"{what} must be an object")
    unknown, missing = set(value) - keys, required - set(value)
    if unknown or missing:
        raise _bad_spec(f"{what}: unknown {sorted(unknown)[:3]} / missing {sorted(missing)[:3]}")
    return value


def _rows(value: Any, what: str, limit: int = 4096) -> list[Any]:
    if not isinstance(value, list | tuple) or len(value) > limit:
        raise _bad_spec(f"{what} must be a list of at most {limit} items")
    return list(value)


def _linear_from(row: Any, what: str) -> Linear:
    row = _obj(row, what, {"name", "d_in", "d_out", "bias"}, {"name", "d_in", "d_out"})
    if not isinstance(row["name"], str) or len(row["name"]) > 300:
        raise _bad_spec(f"{what}.name must be a string")
    if not isinstance(row.get("bias", False), bool):
        raise _bad_spec(f"{what}.bias must be true or false")
    return Linear(row["name"], _int(row["d_in"], f"{what}.d_in", 1),
                  _int(row["d_out"], f"{what}.d_out", 1), row.get("bias", False))  # fmt: skip


def _linears_from(value: Any, what: str) -> tuple[Linear, ...]:
    return tuple(_linear_from(r, f"{what}[{i}]") for i, r in enumerate(_rows(value or [], what)))


def _float(value: Any, what: str, high: float = 1e6) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= high:
        raise _bad_spec(f"{what} must be a number in [0, {high:g}]")
    return float(value)


def _experts_from(value: Any, what: str) -> Experts:
    keys = {f.name for f in fields(Experts)}
    d = _obj(value, what, keys, {"count", "top_k", "linears", "layers"})
    count = _int(d["count"], f"{what}.count", 1)
    if not isinstance(d.get("fused", True), bool):
        raise _bad_spec(f"{what}.fused must be true or false")
    return Experts(
        count=count, top_k=_int(d["top_k"], f"{what}.top_k", 1, count),
        linears=_linears_from(d["linears"], f"{what}.linears"),
        layers=_int(d["layers"], f"{what}.layers"), fused=d.get("fused", True),
        router_params=_int(d.get("router_params", 0), f"{what}.router_params"),
        shared=_linears_from(d.get("shared"), f"{what}.shared"),
        shared_gate_params=_int(d.get("shared_gate_params", 0), f"{what}.shared_gate_params"),
        aux_loss_coef=_float(d.get("aux_loss_coef", 0.0), f"{what}.aux_loss_coef"),
    )  # fmt: skip


def _pairs_from(value: Any, what: str) -> tuple[tuple[str, int], ...]:
    out = []
    for i, pair in enumerate(_rows(value or [], what, 64)):
        if not isinstance(pair, list | tuple) or len(pair) != 2 or not isinstance(pair[0], str):
            raise _bad_spec(f"{what}[{i}] must be a [name, size] pair")
        out.append((pair[0][:100], _int(pair[1], f"{what}[{i}]")))
    return tuple(out)


def _group_from(value: Any, what: str) -> LayerGroup:
    g = _obj(value, what, {"kind", "count"}, {"kind", "count"})
    k = _obj(g["kind"], f"{what}.kind", {f.name for f in fields(LayerKind)}, {"mixers"})
    mixers = []
    for i, m in enumerate(_rows(k["mixers"], f"{what}.kind.mixers", 4)):
        w = f"{what}.kind.mixers[{i}]"
        m = _obj(m, w, {"kind", "linears", "params", "dims"}, {"kind", "linears"})
        if m["kind"] not in MIXER_KINDS:
            raise _bad_spec(f"{w}.kind must be one of {', '.join(MIXER_KINDS)}")
        mixers.append(Mixer(m["kind"], _linears_from(m["linears"], f"{w}.linears"),
                            _int(m.get("params", 0), f"{w}.params"),
                            _pairs_from(m.get("dims"), f"{w}.dims")))  # fmt: skip
    experts = k.get("experts")
    kind = LayerKind(
        mixers=tuple(mixers), mlp=_linears_from(k.get("mlp"), f"{what}.kind.mlp"),
        experts=None if experts is None else _experts_from(experts, f"{what}.kind.experts"),
        norm_params=_int(k.get("norm_params", 0), f"{what}.kind.norm_params"),
        other_linears=_linears_from(k.get("other_linears"), f"{what}.kind.other_linears"),
        other_params=_int(k.get("other_params", 0), f"{what}.kind.other_params"),
    )  # fmt: skip
    return LayerGroup(kind, _int(g["count"], f"{what}.count", 1, MAX_LAYERS))


def spec_from_dict(data: Any) -> ModelSpec:
    """The spec `spec_to_dict` wrote, every field checked (type, range) and the counts positive;
    ModelSpecError for a document that is not one (a damaged or edited cache is derived again)."""
    keys = {f.name for f in fields(ModelSpec)}
    required = {f.name for f in fields(ModelSpec) if f.default is MISSING}
    d = _obj(data, "spec", keys, required)
    if not isinstance(d["model_type"], str) or not 0 < len(d["model_type"]) <= 100:
        raise _bad_spec("model_type must be a short string")
    for name in ("tied_embeddings", "full_logits"):
        if not isinstance(d.get(name, False), bool):
            raise _bad_spec(f"{name} must be true or false")
    for name in ("source", "quantization"):
        if d.get(name) is not None and (not isinstance(d[name], str) or len(d[name]) > 4096):
            raise _bad_spec(f"{name} must be a string")
    ints = {name: _int(d.get(name, 0), name, _SPEC_INT_MIN.get(name, 0),
                       MAX_LAYERS if name in ("layers", "sliding_layers") else MAX_SIZE)
            for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate",
                         "vocab", "max_positions", "embedding_params", "lm_head_params",
                         "norm_params_per_layer", "final_norm_params", "other_params_per_layer",
                         "sliding_window", "sliding_layers", "vision_params", "outer_quantized")}  # fmt: skip
    floats = {name: _float(d.get(name, 0.0), name, 1.0)
              for name in ("attention_dropout", "hidden_dropout", "embedding_dropout")}  # fmt: skip
    blocks = tuple(
        _group_from(g, f"blocks[{i}]") for i, g in enumerate(_rows(d.get("blocks"), "blocks", 1024))
    )
    spec = ModelSpec(**{
        **d, **ints, **floats,
        "linears": _linears_from(d["linears"], "linears"),
        "experts": None if d.get("experts") is None else _experts_from(d["experts"], "experts"),
        "dense_mlp": _linears_from(d.get("dense_mlp"), "dense_mlp"),
        "blocks": blocks, "extras": _pairs_from(d.get("extras"), "extras"),
    })  # fmt: skip
    if blocks and sum(g.count for g in blocks) != spec.layers:
        raise _bad_spec("the layer groups do not add up to the layers")
    if spec.experts is not None and spec.experts.layers > spec.layers:
        raise _bad_spec("more MoE layers than layers")
    if spec.sliding_layers > spec.layers:
        raise _bad_spec("more sliding-window layers than layers")
    if not 0 < spec.active_params <= spec.params or spec.params > MAX_SIZE * 100:
        raise _bad_spec(
            f"its parameter counts are not positive ({spec.params}, {spec.active_params})"
        )
    return spec
