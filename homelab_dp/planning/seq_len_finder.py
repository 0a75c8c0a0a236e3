"""`plan --find-seq-len`: the longest `data.seq_len` that fits, what limits it, what would lift it.

Pure arithmetic over the memory model, as `homelab_dp.planning.micro_batch_search.search_micro_batch` is for
the micro-batch. For a fixed option the per-device bytes grow with the sequence length (every
activation and the loss head are per token; the weights and the optimizer state are not), so the
longest length that fits is found by doubling until it does not fit and then bisecting, token by
token: about 2 × log2(L) budgets, microseconds each.

Three answers, all at the preset's micro-batch:

* ``chosen``: the longest length at which the preset's decision tree finds an option that fits,
  every setting the preset leaves "auto" tried (checkpointing, tiled MLP, offload), and the
  option it would choose there;
* ``candidates``: the same for every (method, distribution) the plan lists, each with the
  preset's auto settings;
* ``lifts``: what one more setting would give the chosen method and distribution (tiled MLP,
  offloaded checkpoints, QLoRA), each with its own longest length. A second card with
  `train.sequence_parallel` is named in words when the preset can have one.

What limits the length is the budget at one token past the longest, split by the part of the
model whose bytes grow with the sequence (`limit_parts`): the saved layer inputs of activation
checkpointing, a layer's attention (q, the output, the mask), the key/value heads (repeated to
the query heads where the kernel needs it), the MLP intermediate (one tile's when tiled), the
residual stream and norms, LoRA's adapter outputs, and the logits of the loss head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from homelab_dp.planning.memory.device_memory import (
    EAGER_ATTENTION_TYPES,
    kv_repeated,
    layer_activation_bytes,
    loss_head_bytes,
)
from homelab_dp.planning.memory.mlp_tiles import mlp_tile_bytes, tiles_mlp
from homelab_dp.planning.memory.moe_memory import adapted_experts, mlp_bytes_per_layer
from homelab_dp.planning.memory.train_shape import (
    TrainShape,
    attention_masked,
    compute_width,
    is_fsdp,
    lora_targets_of,
    offloads,
)
from homelab_dp.planning.model_spec import ModelSpec

MAX_SEQ_LEN = 1 << 22
"""The longest length searched (4M tokens) when the model's positions are not known; else
its ``max_position_embeddings`` (a run refuses a longer `data.seq_len`)."""


def search_seq_len(
    fits: Callable[[int], bool], *, granule: int = 1, high: int = MAX_SEQ_LEN
) -> int:
    """The longest multiple of ``granule`` up to ``high`` with ``fits(length)``, 0 when not even
    ``granule`` fits. ``fits`` must be monotone (true up to some length, false beyond)."""
    if granule < 1 or high < granule:
        raise ValueError("granule must be positive and at most high")
    top = high // granule
    if not fits(granule):
        return 0
    good, step = 1, 1
    while True:  # doubling: find a length that does not fit
        nxt = min(top, good + step)
        if nxt == good:
            return good * granule
        if not fits(nxt * granule):
            bad = nxt
            break
        good, step = nxt, step * 2
    while bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid * granule):
            good = mid
        else:
            bad = mid
    return good * granule


PART_WORDS = {
    "checkpoints": "the checkpointed layer inputs (one hidden-size tensor per layer and token)",
    "attention": "attention's activations (q, the output, the softmax statistics)",
    "mask": "attention's b·s² mask (SDPA with a mask; homelab_packed or FlashAttention has none)",
    "kv": "the key/value heads of attention",
    "mlp": "the MLP intermediate (gate, up, activation, product)",
    "mlp_tile": "one tile of the tiled MLP",
    "residual": "the residual stream and the norms",
    "lora": "LoRA's adapter outputs",
    "logits": "the logits of the loss head",
    "positions": "the model's max_position_embeddings (the card would hold more)",
    "other": "the rest (embeddings, the batch, backward temporaries, other layer kinds)",
}
"""What each part of `limit_parts` is, in the plan's words."""


def limit_parts(spec: ModelSpec, shape: TrainShape, activations: int) -> dict[str, int]:
    """The bytes on the device that grow with the sequence, by part, for ``shape``'s peak.

    ``activations``: the budget's activations component (what the peak holds: every layer's
    saved tensors, or with checkpointing the layer inputs and one recomputed layer, or with
    offloaded activations one layer's). A uniform dense or MoE decoder is split by layer part;
    other families (layer groups, GPT-2) only into activations and logits.
    """
    tokens, w = shape.micro_batch * shape.seq_len, compute_width(shape)
    parts: dict[str, int] = {"logits": int(loss_head_bytes(spec, shape)["backward"])}
    if spec.blocks or spec.model_type == "gpt2":
        parts["other"] = activations
        return parts
    h, attn, kvd = spec.hidden, spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim
    masked = attention_masked(shape) or spec.model_type in EAGER_ATTENTION_TYPES
    if masked or kv_repeated(spec, shape):
        kvd = attn
    trained = shape.method == "full" or bool(adapted_experts(spec, lora_targets_of(shape)))
    layer = {
        "attention": (2 * attn) * w + 4 * (2 + spec.heads),
        "kv": 2 * kvd * w,
        "mask": shape.seq_len * w if masked else 0,
        "mlp": 0 if tiles_mlp(spec, shape) else mlp_bytes_per_layer(spec, w, trained),
        "residual": (24 * h if w == 4 else 28 * h) - (8 * h if shape.method != "full" else 0),
    }
    if shape.method != "full":
        layer["lora"] = layer_activation_bytes(spec, shape) - sum(layer.values())
    offloaded = offloads(shape)[2]
    if shape.activation_checkpointing or offloaded:
        layers_saved = 1  # the layer in hand (recomputed, or its tensors back from the host)
        if shape.activation_checkpointing and not offloaded:
            res = 4 if shape.dtype == "fp32" or not is_fsdp(shape) else 2
            parts["checkpoints"] = spec.layers * h * res * tokens
    else:
        layers_saved = spec.layers
    for name, per_token in layer.items():
        if per_token > 0:
            parts[name] = int(layers_saved * per_token * tokens)
    if tiles_mlp(spec, shape):
        parts["mlp_tile"] = int(mlp_tile_bytes(spec, shape))
    parts["other"] = max(0, activations - sum(v for k, v in parts.items() if k != "logits"))
    return {k: v for k, v in parts.items() if v > 0}


@dataclass(frozen=True)
class SeqLenFit:
    """The longest sequence one (method, distribution) option trains at the preset's micro-batch."""

    method: str
    distribution: str
    max_seq_len: int
    """0: not even the shortest length fits (or the worker cannot train the option here)."""
    supported: bool = True
    activation_checkpointing: bool = False
    tiled_mlp: bool = False
    offload: str = "none"
    offload_activations: bool = False
    total_bytes: int = 0
    """Per-device total at ``max_seq_len``."""
    limit_bytes: int = 0
    limited_by: str = ""
    """The part of `limit_parts` that is largest one token past the longest (PART_WORDS' key)."""
    parts: tuple[tuple[str, int], ...] = ()
    """Bytes by part one token past the longest, largest first."""

    def settings(self) -> str:
        """The settings the longest length needs, in words."""
        out = ["checkpointing" if self.activation_checkpointing else "no checkpointing"]
        if self.tiled_mlp:
            out.append("tiled MLP")
        if self.offload_activations:
            out.append("offloaded activations")
        if self.offload != "none":
            out.append(f"offload {self.offload}")
        return ", ".join(out)

    def describe(self) -> str:
        """One line: the option, its longest length and what limits it."""
        name = f"{self.method} · {self.distribution}"
        if not self.supported:
            return f"{name}: cannot train here"
        if self.max_seq_len == 0:
            return f"{name}: not even 1 token fits"
        limit = f"; limited by {PART_WORDS[self.limited_by]}" if self.limited_by else ""
        return f"{name}: {self.max_seq_len:,} tokens ({self.settings()}){limit}"

    def to_json(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "distribution": self.distribution,
            "max_seq_len": self.max_seq_len,
            "supported": self.supported,
            "activation_checkpointing": self.activation_checkpointing,
            "tiled_mlp": self.tiled_mlp,
            "offload": self.offload,
            "offload_activations": self.offload_activations,
            "total_bytes": self.total_bytes,
            "limit_bytes": self.limit_bytes,
            "limited_by": self.limited_by or None,
            "limit_parts_bytes": dict(self.parts),
        }


@dataclass(frozen=True)
class Lift:
    """What one more setting would give the chosen option's longest length."""

    setting: str
    """The preset line, e.g. ``train.tiled_mlp = "on"``."""
    words: str
    max_seq_len: int | None
    """The longest length with it (None: not computed here, e.g. a second card)."""

    def to_json(self) -> dict[str, Any]:
        return {"setting": self.setting, "words": self.words, "max_seq_len": self.max_seq_len}


@dataclass(frozen=True)
class SeqLenFinder:
    """`plan --find-seq-len`'s answer (`plan --json`'s ``seq_len_finder``)."""

    chosen: SeqLenFit
    candidates: tuple[SeqLenFit, ...]
    lifts: tuple[Lift, ...] = ()
    micro_batch: int = 1
    planned_seq_len: int = 0
    """The preset's data.seq_len (what the rest of the plan is for)."""
    max_positions: int = 0
    """The model's position limit (0: not known): longer lengths fit memory but not the model."""

    @property
    def max_seq_len(self) -> int:
        return self.chosen.max_seq_len

    def reasons(self) -> list[str]:
        """The plan's lines: the longest length, what limits it and what would lift it."""
        c = self.chosen
        if c.max_seq_len == 0:
            head = "Sequence-length finder: not even a 1-token sequence fits."
        else:
            head = (
                f"Sequence-length finder: {c.max_seq_len:,} tokens is the longest data.seq_len "
                f"that fits at micro-batch {self.micro_batch} ({c.method} · {c.distribution}, "
                f"{c.settings()}; {c.total_bytes / 2**30:.2f} of {c.limit_bytes / 2**30:.2f} GiB "
                "usable)."
            )
        out = [head]
        if c.limited_by == "positions":
            out.append(
                f"What limits it: the model's {self.max_positions:,} positions "
                "(max_position_embeddings; a run refuses a longer data.seq_len), not the memory."
            )
        elif c.limited_by:
            total = sum(v for _, v in c.parts) or 1
            top = ", ".join(f"{PART_WORDS[k]} {v / 2**30:.2f} GiB ({100 * v / total:.0f}%)"
                            for k, v in c.parts[:3])  # fmt: skip
            out.append(f"What limits it one token further: {top}.")
        for lift in self.lifts:
            more = f": {lift.max_seq_len:,} tokens" if lift.max_seq_len is not None else ""
            out.append(f"Would lift it: {lift.setting} ({lift.words}){more}.")
        return out

    def candidate_lines(self) -> list[str]:
        """One line per candidate (the text output)."""
        return [c.describe() for c in self.candidates]

    def to_json(self) -> dict[str, Any]:
        return {
            "max_seq_len": self.chosen.max_seq_len,
            "micro_batch": self.micro_batch,
            "planned_seq_len": self.planned_seq_len,
            "max_positions": self.max_positions or None,
            "chosen": self.chosen.to_json(),
            "candidates": [c.to_json() for c in self.candidates],
            "lifts": [lift.to_json() for lift in self.lifts],
        }
