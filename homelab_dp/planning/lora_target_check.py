"""``lora.target_modules`` checked against the model before anything is planned or started.

A name that matches no module of the model would be planned as adapting nothing (0 trainable
parameters, "fits"), then fail in rank 0 when peft finds no target; a typo among good names
would silently train fewer adapters than asked. Every name must pick something of the model as
the planner counts it (`planning.memory.moe_memory.adapted`: the decoder linears, a MoE model's
dense MLP, shared and routed experts), matched as peft matches a list: the module's name or a
dotted tail of it (``q_proj``, ``self_attn.q_proj``), or a full path ending in one
(``model.layers.0.self_attn.q_proj``). The few modules outside the decoder blocks that peft can
adapt too (`OUTSIDE_BLOCKS`: the output layer, the token embeddings) are accepted as named.
"""

from __future__ import annotations

from homelab_dp.errors import PresetError
from homelab_dp.planning.memory.moe_memory import adapted
from homelab_dp.planning.model_spec import ModelSpec

ALL_LINEAR = "all-linear"
OUTSIDE_BLOCKS = ("lm_head", "embed_tokens", "embed_out", "wte", "wpe", "output")
"""Module names outside the decoder blocks that peft adapts when named (not counted by the
planner, which plans the decoder's adapters)."""
EXPERTS = ("experts", "experts.gate_up_proj", "experts.down_proj")
"""The names that ask for a MoE model's routed experts (`train.model.lora.EXPERT_TARGETS`)."""


def _picks(spec: ModelSpec, name: str) -> bool:
    """Whether ``name`` (or a dotted tail of a full path) picks something the planner counts."""
    parts = name.split(".")
    return any(adapted(spec, [".".join(parts[i:])]) for i in range(len(parts)))


def known_targets(spec: ModelSpec) -> list[str]:
    """The module names ``lora.target_modules`` may list for this model (for the hint)."""
    names = [lin.name.split(".")[-1] for lin, _ in adapted(spec, ALL_LINEAR)]
    if adapted(spec, ["experts"]):
        names.append("experts")
    return list(dict.fromkeys(names))


def check_lora_targets(spec: ModelSpec, targets: str | list[str], source: str = "") -> None:
    """Refuse (PresetError naming ``lora.target_modules``) a target spec of which any name picks
    nothing of ``spec``'s model, or that picks nothing at all; "all-linear" always passes."""
    if targets == ALL_LINEAR:
        return
    names = [targets] if isinstance(targets, str) else list(targets)
    where = f"{source}: " if source else ""
    known = known_targets(spec)
    hint = (f"{spec.model_type} has {', '.join(known)} in each decoder layer; "
            'or use "all-linear"')  # fmt: skip
    if not names:
        raise PresetError(f"{where}lora.target_modules: an empty list adapts nothing", hint=hint)
    for name in names:
        if not isinstance(name, str) or not name.strip():
            raise PresetError(f"{where}lora.target_modules: {name!r} is not a module name",
                              hint=hint)  # fmt: skip
        if name in OUTSIDE_BLOCKS:
            continue
        if name == ALL_LINEAR:
            if adapted(spec, ["experts"]):  # beside "experts" on a MoE model: the worker expands it
                continue
            raise PresetError(
                f'{where}lora.target_modules: "all-linear" is a value of its own, not a name '
                "in a list",
                hint=f'set lora.target_modules = "all-linear", or list module names: {hint}',
            )
        if name in EXPERTS and not _picks(spec, name):
            raise PresetError(
                f"{where}lora.target_modules: {name!r} names routed experts, but "
                f"{spec.model_type} has none",
                hint=hint,
            )
        if not _picks(spec, name):
            raise PresetError(
                f"{where}lora.target_modules: {name[:100]!r} names no module of the model "
                f"({spec.model_type})",
                hint=hint,
            )
