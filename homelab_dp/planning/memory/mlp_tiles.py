"""Tiled MLP (`train.tiled_mlp`): each decoder layer's MLP computed in tiles along the sequence.

ALST's idea (Arctic Long Sequence Training, TiledMLP): the MLP of a dense decoder layer is
applied token by token, so it may be applied to slices of the sequence one after another. The
worker's `homelab_dp.train.model.tiled_mlp` runs each tile under ``no_grad`` in the forward (nothing of
the MLP is saved but its input) and recomputes each tile with grad in the backward, one tile at
a time, so the MLP's intermediate tensors (gate, up, the activation, their product; and their
gradients) exist for one tile, never for the whole sequence. Exact: the same loss and gradients
as without it, at one more MLP forward per micro-step.

This module is the rule both sides share (pure): which models are tiled, how many tiles a
micro-batch is cut into, and the bytes a tile's MLP holds. The memory model
(`homelab_dp.planning.memory.device_memory`) prices the MLP intermediate per tile, not per
sequence; the worker cuts the tiles this module says.
"""

from __future__ import annotations

import math

from homelab_dp.planning.memory.moe_memory import adapted, mlp_bytes_per_layer, mlp_temporaries
from homelab_dp.planning.memory.train_shape import TrainShape, compute_width, lora_targets_of
from homelab_dp.planning.model_spec import ModelSpec

MLP_LINEAR_NAMES = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "fc1", "fc2")
"""The last part of a dense MLP's linears' names (LLaMA-style gated MLPs, Phi-3's fused
gate/up)."""


def tiled_mlp_refusal(spec: ModelSpec) -> str:
    """Why ``spec``'s MLPs are left untiled ("" when they can be tiled).

    Tiled: the uniform dense decoders (LLaMA, Qwen2/3, Mistral, Phi-3 and their kin), whose
    MLP maps each token on its own. Left untiled: a MoE block (its router and the experts'
    token dispatch change with the tile, so recomputing a tile is a different computation to
    check; its routed activations are counted per routed token already), the layer-group
    families (hybrids) and GPT-2 (its MLP is a ``Conv1D`` pair; short sequences).
    """
    if spec.experts is not None:
        return "a MoE model's expert blocks are left untiled (routing is per tile)"
    if spec.blocks:
        return "layer-group (hybrid) families are left untiled"
    if spec.model_type == "gpt2":
        return "GPT-2's MLP is left untiled"
    return ""


def tiled_mlp_options(spec: ModelSpec, setting: str) -> tuple[bool, ...]:
    """The `train.tiled_mlp` settings the planner's tree tries: on, off, or for "auto" off then
    on (tiled only where nothing untiled fits: the MLP intermediate is what limits); never on
    for a model whose MLPs stay untiled (`tiled_mlp_refusal`)."""
    if setting == "off" or tiled_mlp_refusal(spec):
        return (False,)
    return (True,) if setting == "on" else (False, True)


def mlp_tiles(tokens: int, hidden: int) -> int:
    """How many tiles a micro-batch of ``tokens`` is cut into: ceil(tokens / hidden), ALST's
    rule (a tile about as long as the hidden size, so a tile's intermediate is about the size of
    the hidden states of ``hidden`` tokens × intermediate / hidden), at least 1."""
    return max(1, math.ceil(tokens / max(1, hidden)))


def mlp_tile_tokens(tokens: int, hidden: int) -> int:
    """Tokens in the largest tile (the tiles are as equal as ``ceil`` makes them)."""
    return math.ceil(tokens / mlp_tiles(tokens, hidden))


def tiles_mlp(spec: ModelSpec, shape: TrainShape) -> bool:
    """Whether ``shape`` runs ``spec``'s MLPs tiled: asked for, the model's MLPs can be, and a
    micro-batch makes two tiles or more (with one the worker runs the MLP as it is)."""
    tokens = shape.micro_batch * shape.seq_len
    return shape.tiled_mlp and not tiled_mlp_refusal(spec) and mlp_tiles(tokens, spec.hidden) > 1


def _is_mlp(name: str) -> bool:
    return name.rsplit(".", 1)[-1] in MLP_LINEAR_NAMES


def _mlp_adapted(spec: ModelSpec, shape: TrainShape) -> list:
    if shape.method == "full":
        return []
    dense = set(spec.linears)
    return [
        lin
        for lin, _ in adapted(spec, lora_targets_of(shape))
        if lin in dense and _is_mlp(lin.name)
    ]


def mlp_lora_outputs(spec: ModelSpec, shape: TrainShape) -> int:
    """Adapted MLP linears per decoder layer (each saves its lora_A output, r per token, inside
    the MLP: a tiled MLP saves none of them); 0 for a full fine-tune."""
    return len(_mlp_adapted(spec, shape))


def mlp_forward_flops_per_token(spec: ModelSpec, shape: TrainShape) -> float:
    """FLOPs of every layer's MLP forward for one token (adapters included): what a tiled MLP
    recomputes in backward (0 when ``shape`` does not tile `spec`'s MLPs)."""
    if not tiles_mlp(spec, shape):
        return 0.0
    per_layer = 2.0 * sum(lin.d_in * lin.d_out for lin in spec.linears if _is_mlp(lin.name))
    per_layer += sum(
        2.0 * shape.lora_r * (lin.d_in + lin.d_out) for lin in _mlp_adapted(spec, shape)
    )
    return per_layer * spec.layers


def mlp_trainable_params(spec: ModelSpec, shape: TrainShape) -> int:
    """Trainable parameters of one decoder layer's MLP: its linears (full fine-tune) or their
    adapters (r × (in + out) each), whose gradients a tiled MLP sums over the tiles."""
    if shape.method == "full":
        return sum(lin.params for lin in spec.linears if _is_mlp(lin.name))
    return sum(shape.lora_r * (lin.d_in + lin.d_out) for lin in _mlp_adapted(spec, shape))


def tiled_mlp_saved(spec: ModelSpec, shape: TrainShape, mlp: float) -> float:
    """The MLP's saved bytes per token, ``mlp`` untiled: 0 with a tiled MLP (`train.tiled_mlp`,
    `homelab_dp.planning.memory.mlp_tiles`), whose tiles save nothing but the MLP's input (the
    norm's output, counted with the layer) and are recomputed one at a time in backward."""
    return 0.0 if tiles_mlp(spec, shape) else mlp


def mlp_tile_bytes(spec: ModelSpec, shape: TrainShape) -> float:
    """Bytes one tile of a tiled MLP holds in backward: its recomputed intermediate tensors and
    adapters' outputs, the intermediate-wide gradients of its backward, and the tile's input
    gradient (0 when the MLP is not tiled: the untiled intermediate is per token)."""
    if not tiles_mlp(spec, shape):
        return 0.0
    w = compute_width(shape)
    tile = mlp_tile_tokens(shape.micro_batch * shape.seq_len, spec.hidden)
    trained = shape.method == "full"
    per_token = mlp_bytes_per_layer(spec, w, trained) + mlp_temporaries(spec) * w
    per_token += mlp_lora_outputs(spec, shape) * shape.lora_r * w + spec.hidden * w
    # The MLP's parameter gradients, summed over the tiles: the running sum and this tile's.
    return per_token * tile + 2 * 4 * mlp_trainable_params(spec, shape)
