"""Whether ``data.pack`` can stay on for a model with recurrent layers (pure).

A packed block holds several samples one after the other. Attention keeps each sample to itself
from the positions restarting at 0 (`homelab_dp.planning.attention_rule`); a layer that carries
a state from token to token does not: Gated DeltaNet (linear attention: Qwen3.5, Qwen3-Next,
Kimi Linear, OLMo hybrid), Mamba and Mamba-2 (state-space: Nemotron-H, Falcon-H1, Granite 4
hybrids, Bamba, Jamba, Zamba), MiniMax's lightning attention, LFM2's short convolutions and
RecurrentGemma's recurrent blocks all read the previous sample's tokens through their recurrent
state or convolution window, so the next sample of the block trains on a state it would never
have alone.

What transformers 5.25 does with sample boundaries on these layers (its modeling code):

- the torch reference path (``torch_chunk_gated_delta_rule``, the Mamba-2 ``torch_forward``,
  the ``F.conv1d`` fallback of ``causal_conv1d_fn``, LFM2's short convolution) takes none: no
  ``seq_idx``, no ``cu_seqlens``, and ``position_ids`` do not reach them. This is the path of
  every CPU run and of a CUDA run without the kernels (measured on the tiny models of
  tests/tiny_hybrids.py: a packed block's logits differ from its samples' alone).
- the CUDA kernels can take them (flash-linear-attention's ``chunk_gated_delta_rule`` reads
  ``cu_seq_lens_q`` from the forward's keyword arguments, mamba-ssm's fused scan a ``seq_idx``
  the decoder layers pass down), but the depthwise convolution in front of Gated DeltaNet gets
  the same keyword arguments, which causal-conv1d spells ``seq_idx``, and no machine this is
  tested on has those kernels: not proven, so not relied on.

So packing is turned off before launch for every model with such a layer (`packing_decision`):
one sample per row, each micro-batch cut to its longest sample and the samples of each
optimizer step grouped by length, so padding stays small (`homelab_dp.train` does both, from the
same rule). The worker's packing check (`homelab_dp.train.model.packing_check`) stays the guard for
whatever reaches it packed.

The plan reads the layer kinds from the model spec's layers (`spec_recurrent_kinds`, the
census of the model transformers builds), the worker from ``config.json`` (`recurrent_kinds`);
tests/unit/train/test_recurrent_packing_models.py checks that both name the families whose
packed blocks leak.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from homelab_dp.planning.model_spec import STATE_KINDS, ModelSpec

RECURRENT_KINDS = frozenset({
    "linear_attention", "mamba", "mamba2", "conv", "short_conv", "recurrent", "hybrid", "rwkv",
    "mlstm", "slstm", "lightning_attention",
})  # fmt: skip
"""Layer kinds (as transformers' configs spell them in ``layer_types``, ``layers_block_type``
or ``block_types``) that carry a state from token to token. transformers calls Nemotron-H's and
Granite 4's Mamba-2 layers ``linear_attention`` too, and Zamba2's shared-attention Mamba layers
``hybrid``; the model spec's mixer kinds (``short_conv``, ``mamba2``, ...) are here too."""
ALL_RECURRENT = {
    "mamba": "mamba", "mamba2": "mamba2", "falcon_mamba": "mamba", "falcon_h1": "mamba2",
    "bamba": "mamba2", "jamba": "mamba", "zamba": "mamba", "zamba2": "mamba2", "rwkv": "rwkv",
    "xlstm": "mlstm", "plamo2": "mamba2", "recurrent_gemma": "recurrent",
}  # fmt: skip
"""Families with a recurrent layer whatever their config lists (``model_type`` → its kind):
Falcon-H1 runs attention and Mamba-2 side by side in every layer, the others have Mamba or
recurrent blocks in every layer or a pattern without a per-layer list."""
_LAYER_LISTS = ("layer_types", "layers_block_type", "block_types")
_PATTERN = {"M": "mamba2", "*": "attention", "-": "mlp", "E": "moe"}
"""Nemotron-H's ``hybrid_override_pattern``: one character per layer."""


def _text(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's config of a multimodal wrapper (``text_config``), else ``cfg``."""
    text = cfg.get("text_config")
    return text if isinstance(text, Mapping) else cfg


def recurrent_kinds(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The recurrent layer kinds (`RECURRENT_KINDS`) a ``config.json`` declares, sorted; () for
    a model whose every token mixer is attention."""
    text = _text(cfg)
    model_type = str(cfg.get("model_type", ""))
    kinds: set[str] = set()
    for source in (cfg, text):
        for key in _LAYER_LISTS:
            values = source.get(key)
            if isinstance(values, list):
                kinds |= {str(v) for v in values if str(v) in RECURRENT_KINDS}
        pattern = source.get("hybrid_override_pattern")
        if isinstance(pattern, str) and "M" in pattern:
            kinds.add(_PATTERN["M"])
    for mt in (model_type, str(text.get("model_type", ""))):
        if mt in ALL_RECURRENT:
            kinds.add(ALL_RECURRENT[mt])
    # LFM2 given by its attention layers' indices: every other layer is a short convolution.
    idxs, layers = text.get("full_attn_idxs"), text.get("num_hidden_layers")
    listed = isinstance(text.get("layer_types"), list)
    if (
        isinstance(idxs, list)
        and isinstance(layers, int)
        and len(set(idxs)) < layers
        and not listed
    ):
        kinds.add("conv")
    return tuple(sorted(kinds))


def spec_recurrent_kinds(spec: ModelSpec) -> tuple[str, ...]:
    """The mixer kinds of the model spec's layers that carry a state (`STATE_KINDS`: Gated
    DeltaNet's ``linear_attention``, ``mamba2``, ``short_conv``, ...), sorted."""
    return tuple(sorted({m.kind for g in spec.layer_groups for m in g.kind.mixers
                         if m.kind in STATE_KINDS}))  # fmt: skip


def model_recurrent_kinds(spec: ModelSpec, cfg: Mapping[str, Any]) -> tuple[str, ...]:
    """The plan's reading: the spec's layer kinds (`spec_recurrent_kinds`), or where the spec
    describes none (a spec written by hand for an attention family), config.json's
    (`recurrent_kinds`, which the worker reads too)."""
    return spec_recurrent_kinds(spec) or recurrent_kinds(cfg)


@dataclass(frozen=True)
class PackingDecision:
    """What `packing_decision` decided for ``data.pack``."""

    pack: bool
    """Whether the run trains on packed blocks."""
    group_by_length: bool
    """Unpacked rows of a recurrent model: each optimizer step's samples sorted by length and
    each micro-batch cut to its longest sample (exact: the padding is at the end of a row)."""
    reason: str
    """One sentence for the plan, "" when there is nothing to say."""


def packing_decision(requested: bool, kinds: Collection[str], model_type: str) -> PackingDecision:
    """``data.pack`` as the run will train: ``requested`` (the preset's data.pack) unless the
    model has a recurrent layer kind (``kinds``: `recurrent_kinds`, or the model spec's layer
    kinds), which no path here can hand sample boundaries to (see the module docstring)."""
    recurrent = sorted(k for k in kinds if k in RECURRENT_KINDS)
    if not recurrent:
        return PackingDecision(pack=requested, group_by_length=False, reason="")
    if not requested:
        return PackingDecision(pack=False, group_by_length=True, reason="")
    names = ", ".join(recurrent)
    return PackingDecision(
        pack=False,
        group_by_length=True,
        reason=(
            f"Packing off (data.pack = true asked): {model_type}'s {names} layers carry a state "
            "from token to token, which the torch reference path carries across the samples of "
            "a packed block (and the CUDA kernels' sample boundaries are not proven); it trains "
            "unpacked, one sample per row, each step's samples grouped by length and each "
            "micro-batch cut to its longest sample."
        ),
    )
