"""Model shape and exact parameter count from a Hugging Face `config.json` alone (no torch).

Hand-written families (`SUPPORTED`): dense LLaMA, Mistral, Qwen2, Qwen3, Gemma, Gemma2,
Gemma3 (text and the vision wrapper), OLMo2, Granite, SmolLM3, GLM-4, Phi-3 and GPT-2, and the
Mixture-of-Experts Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, gpt-oss and DeepSeek-V2. The counts
match instantiating the model through transformers 5 on the meta device, parameter for
parameter (the tests check it). Other decoders are derived from transformers' module tree
(`train/model_census.py`, read back by `spec_from_dict`).
"""

from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from homelab_dp.errors import ModelSpecError

LLAMA_LIKE = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2")
DENSE_FAMILIES = ("gemma3_text", "gemma3", "olmo2", "granite", "smollm3", "glm4")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "olmoe", "mixtral", "gpt_oss", "deepseek_v2")
SUPPORTED = (*LLAMA_LIKE, "phi3", "gpt2", *DENSE_FAMILIES, *MOE_FAMILIES)
# Encoders transformers would build as a causal LM (``is_decoder``) from weights trained
# bidirectionally, and encoder-decoders: refused before anything is built.
ENCODER_ONLY = frozenset({
    "bert", "roberta", "xlm-roberta", "xlm-roberta-xl", "camembert", "electra", "ernie",
    "data2vec-text", "bert-generation", "roformer", "megatron-bert", "rembert", "xmod",
    "big_bird", "roc_bert", "roberta-prelayernorm", "modernbert", "deberta", "deberta-v2",
    "distilbert", "albert", "mpnet", "nomic_bert", "jina_bert",
})  # fmt: skip
SEQ2SEQ = frozenset({
    "t5", "mt5", "umt5", "longt5", "bart", "mbart", "pegasus", "pegasus_x", "marian",
    "blenderbot", "blenderbot-small", "led", "plbart", "bigbird_pegasus", "prophetnet",
    "switch_transformers", "fsmt", "m2m_100", "nllb-moe", "mvp", "whisper", "t5gemma",
})  # fmt: skip
MAX_LAYERS = 4096
"""The most decoder layers a config.json may state (released models have at most a few
hundred): every count the planner or the census loops over is bounded by it."""
DECODER_HINT = (
    "homelab-dp fine-tunes decoder-only causal language models (llama, qwen3, mistral, gemma3, ...)"
)


@dataclass(frozen=True)
class Linear:
    """One linear layer inside a decoder block (repeated in every layer)."""

    name: str
    d_in: int
    d_out: int
    bias: bool = False

    @property
    def params(self) -> int:
        return self.d_in * self.d_out + (self.d_out if self.bias else 0)


@dataclass(frozen=True)
class Experts:
    """The Mixture-of-Experts block of a model's MoE layers (one instance describes them all)."""

    count: int
    """Routed experts per MoE layer (``num_experts``, ``num_local_experts``, ``n_routed_experts``)."""
    top_k: int
    """Routed experts each token goes through (``num_experts_per_tok``)."""
    linears: tuple[Linear, ...]
    """One routed expert's projections as 2-D shapes (gate/up, possibly fused, and down)."""
    layers: int
    """How many decoder layers are MoE; the others run `ModelSpec.dense_mlp`."""
    fused: bool = True
    """The experts are stored as 3-D tensors ``[count, ...]`` (transformers 5), not as
    ``nn.Linear``: peft reaches them through ``target_parameters`` and bitsandbytes cannot."""
    router_params: int = 0
    """The router's weight (and bias) per MoE layer: kept 16-bit, frozen under LoRA."""
    shared: tuple[Linear, ...] = ()
    """Shared experts' linears (``nn.Linear``), run for every token in every MoE layer."""
    shared_gate_params: int = 0
    """A shared expert's own gate per MoE layer (Qwen2-MoE's ``shared_expert_gate``)."""
    aux_loss_coef: float = 0.0
    """The router's load-balancing loss weight (``router_aux_loss_coef``; 0: none is added)."""

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert."""
        return sum(lin.params for lin in self.linears)

    @property
    def shared_params(self) -> int:
        """Shared experts, their gate and the router: what every token uses in a MoE layer."""
        return sum(lin.params for lin in self.shared) + self.shared_gate_params + self.router_params

    @property
    def layer_params(self) -> int:
        """Every parameter of one MoE layer's MLP block."""
        return self.count * self.expert_params + self.shared_params

    @property
    def active_layer_params(self) -> int:
        """The parameters one token uses in a MoE layer's MLP block (top-k experts)."""
        return self.top_k * self.expert_params + self.shared_params


MIXER_KINDS = (
    "attention", "sliding_attention", "chunked_attention", "mla", "gated_attention",
    "linear_attention", "mamba2", "mamba", "short_conv", "recurrent",
)  # fmt: skip
"""Token mixers a decoder layer may hold. ``attention``: full causal softmax attention;
``sliding_attention`` / ``chunked_attention``: limited to a window or a chunk; ``mla``:
multi-head latent attention (DeepSeek); ``gated_attention``: attention whose output is gated by a
sigmoid of the input (Qwen3-Next, Qwen3.5); ``linear_attention``: Gated DeltaNet (a recurrent
state per head, a short causal convolution); ``mamba2`` / ``mamba``: selective state-space
(Mamba-2, Mamba-1); ``short_conv``: LFM2's gated short convolution; ``recurrent``: any other
recurrent mixer (RWKV, xLSTM, RG-LRU), planned with a generic activation estimate."""
ATTENTION_KINDS = frozenset({"attention", "sliding_attention", "chunked_attention", "mla",
                             "gated_attention"})  # fmt: skip
STATE_KINDS = frozenset({"linear_attention", "mamba2", "mamba", "short_conv", "recurrent"})
"""Mixers that carry a recurrent (or convolution) state from token to token: a packed block must
not carry it across a sample boundary."""


@dataclass(frozen=True)
class Mixer:
    """One token mixer of a decoder layer (a layer may hold two side by side: Falcon-H1)."""

    kind: str
    """One of `MIXER_KINDS`."""
    linears: tuple[Linear, ...]
    """Its ``nn.Linear`` projections (names relative to the decoder layer)."""
    params: int = 0
    """Its parameters outside the linears: convolution weights, ``A_log``, ``dt_bias``, ``D``,
    its inner norms, q/k norms, attention sinks."""
    dims: tuple[tuple[str, int], ...] = ()
    """Sizes the memory and FLOPs models read, by name: attention ``heads``, ``kv_heads``,
    ``head_dim``, ``window``; Gated DeltaNet ``k_heads``, ``v_heads``, ``k_dim``, ``v_dim``,
    ``conv_kernel``; Mamba-2 ``heads``, ``head_dim``, ``state``, ``groups``, ``conv_kernel``,
    ``inner``; short convolution ``conv_kernel``, ``width``."""

    def dim(self, name: str, default: int = 0) -> int:
        """The size ``name`` of `dims` (``default`` when not given)."""
        return next((v for k, v in self.dims if k == name), default)

    @property
    def total_params(self) -> int:
        """Linears and the rest."""
        return sum(lin.params for lin in self.linears) + self.params


@dataclass(frozen=True)
class LayerKind:
    """One kind of decoder layer: its mixer(s), its MLP (dense, MoE or none) and the rest."""

    mixers: tuple[Mixer, ...]
    """() for a layer that is only an MLP (Nemotron-H's MLP and MoE blocks); two for
    attention and Mamba-2 side by side (Falcon-H1)."""
    mlp: tuple[Linear, ...] = ()
    """A dense MLP's linears (empty in a MoE layer, or a mixer-only layer)."""
    experts: Experts | None = None
    """The MoE block (its ``layers`` field is not used here: the group's count says it)."""
    norm_params: int = 0
    """The layer's own norms."""
    other_linears: tuple[Linear, ...] = ()
    """Any other ``nn.Linear`` of the layer (Gemma 4's per-layer input gate and projection)."""
    other_params: int = 0
    """Any other parameter of the layer (a layer scalar, norms inside the MLP)."""

    @property
    def mixer(self) -> str:
        """The kind of the layer's mixer: one of `MIXER_KINDS`, ``"a+b"`` for two side by
        side, ``"none"`` for an MLP-only layer."""
        return "+".join(m.kind for m in self.mixers) or "none"

    @property
    def linears(self) -> tuple[Linear, ...]:
        """Every ``nn.Linear`` of the layer but the routed experts and the router."""
        shared = self.experts.shared if self.experts else ()
        return (*(lin for m in self.mixers for lin in m.linears), *self.mlp, *shared,
                *self.other_linears)  # fmt: skip

    @property
    def params(self) -> int:
        """Every parameter of one such layer (every expert counted)."""
        moe = self.experts.layer_params if self.experts else 0
        return (sum(m.total_params for m in self.mixers) + sum(lin.params for lin in self.mlp)
                + moe + self.norm_params + sum(lin.params for lin in self.other_linears)
                + self.other_params)  # fmt: skip

    @property
    def active_params(self) -> int:
        """The parameters a token goes through (top-k of the routed experts)."""
        if self.experts is None:
            return self.params
        e = self.experts
        return self.params - (e.count - e.top_k) * e.expert_params

    @property
    def quantizable_params(self) -> int:
        """What 4-bit QLoRA quantizes: the linears, shared and routed experts (not the router)."""
        routed = self.experts.count * self.experts.expert_params if self.experts else 0
        return sum(lin.params for lin in self.linears) + routed

    @property
    def carries_state(self) -> bool:
        """A mixer carries a recurrent or convolution state from token to token."""
        return any(m.kind in STATE_KINDS for m in self.mixers)


@dataclass(frozen=True)
class LayerGroup:
    """``count`` decoder layers of one kind (equal layers grouped wherever they sit)."""

    kind: LayerKind
    count: int


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model."""

    model_type: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    max_positions: int
    tied_embeddings: bool
    linears: tuple[Linear, ...]
    """The linear layers of EVERY decoder block (what LoRA adapts and QLoRA quantizes): for a
    dense model attention and MLP, for a MoE model attention only (see `dense_mlp`, `experts`)."""
    embedding_params: int
    """Token (and position) embeddings."""
    lm_head_params: int
    """0 when tied to the embeddings."""
    norm_params_per_layer: int
    final_norm_params: int
    other_params_per_layer: int = 0
    """Anything else per layer (biases outside linears, q/k norms)."""
    source: str = "config.json"
    """How the count was obtained: "config.json" or "meta-device"."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities (GPT-2's attn_pdrop). On the CPU it makes SDPA
    fall back to the math kernel, which keeps batch × heads × seq² tensors for backward."""
    hidden_dropout: float = 0.0
    """Dropout on each residual branch (GPT-2's resid_pdrop, Phi-3's resid_pdrop)."""
    embedding_dropout: float = 0.0
    """Dropout on the embeddings (GPT-2's embd_pdrop)."""
    experts: Experts | None = None
    """The MoE block of a Mixture-of-Experts model; None for a dense model."""
    dense_mlp: tuple[Linear, ...] = ()
    """The MLP linears of a MoE model's dense layers (``mlp_only_layers``,
    ``first_k_dense_replace``); empty for a dense model, whose MLP is in `linears`."""
    sliding_window: int = 0
    """The attention window of the sliding-window layers (0: every layer attends to all)."""
    sliding_layers: int = 0
    """How many decoder layers use `sliding_window`."""
    vision_params: int = 0
    """A multimodal wrapper's vision tower and projector: loaded and frozen (0: text only)."""
    quantization: str | None = None
    """A pre-quantized checkpoint's ``quantization_config.quant_method`` (e.g. "mxfp4")."""
    full_logits: bool = False
    """The logits are transformed after lm_head (soft-capping, scaling): the loss keeps the
    full-logits path instead of the chunked head."""
    blocks: tuple[LayerGroup, ...] = ()
    """The decoder layers as groups of equal layers, for a model whose layers are not all one
    attention layer (hybrids, per-layer sizes, dense and MoE layers of different shapes).
    Empty: every layer is `linears` (+ the MoE block or `dense_mlp`), the uniform form; the
    counts then follow the fields above. Set: the counts, memory and FLOPs follow the groups;
    `linears` lists each distinct decoder linear once (for name look-ups) and
    `norm_params_per_layer` / `other_params_per_layer` are 0."""
    extras: tuple[tuple[str, int], ...] = ()
    """Parameters a family adds outside the decoder layers, by name (Gemma 4's per-layer input
    embeddings and projection, a shared transformer block): counted in `params`, frozen
    weights to the memory model. ``mtp_layers_not_built`` (a count, not parameters): MTP heads in
    the checkpoint that transformers does not build and training does not use."""

    @property
    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """The decoder layers as groups of equal layers: `blocks`, or for the uniform form one
        group (a MoE model: its MoE layers and its dense layers)."""
        if self.blocks:
            return self.blocks
        kind = "sliding_attention" if self.sliding_layers >= self.layers > 0 else "attention"
        mixer = Mixer(kind, self.linears, self.other_params_per_layer,
                      (("heads", self.heads), ("kv_heads", self.kv_heads),
                       ("head_dim", self.head_dim), ("window", self.sliding_window)))  # fmt: skip
        if self.experts is None:
            return (LayerGroup(LayerKind((mixer,), norm_params=self.norm_params_per_layer),
                               self.layers),)  # fmt: skip
        out = [
            LayerGroup(
                LayerKind((mixer,), experts=self.experts, norm_params=self.norm_params_per_layer),
                self.moe_layers,
            )
        ]
        if self.layers > self.moe_layers:
            out.append(LayerGroup(LayerKind((mixer,), mlp=self.dense_mlp,
                                            norm_params=self.norm_params_per_layer),
                                  self.layers - self.moe_layers))  # fmt: skip
        return tuple(g for g in out if g.count)

    @property
    def extra_params(self) -> int:
        """Parameters outside the decoder layers that `extras` names (counts left out)."""
        return sum(n for name, n in self.extras if name != "mtp_layers_not_built")

    @property
    def mixer_counts(self) -> dict[str, int]:
        """Layers per mixer kind (`LayerKind.mixer`)."""
        out: dict[str, int] = {}
        for g in self.layer_groups:
            out[g.kind.mixer] = out.get(g.kind.mixer, 0) + g.count
        return out

    @property
    def state_layers(self) -> int:
        """Layers whose mixer carries a recurrent or convolution state (`STATE_KINDS`): a
        packed block must not let it leak from one sample into the next."""
        return sum(g.count for g in self.layer_groups if g.kind.carries_state)

    @property
    def attention_layers(self) -> int:
        """Layers with softmax attention (those that keep a KV cache when serving)."""
        return sum(
            g.count
            for g in self.layer_groups
            if any(m.kind in ATTENTION_KINDS for m in g.kind.mixers)
        )

    @property
    def linear_params_per_layer(self) -> int:
        return sum(lin.params for lin in self.linears)

    @property
    def layer_params(self) -> int:
        return (
            self.linear_params_per_layer + self.norm_params_per_layer + self.other_params_per_layer
        )

    @property
    def moe_layers(self) -> int:
        """Decoder layers with experts (0 for a dense model)."""
        return self.experts.layers if self.experts else 0

    def _mlp_params(self, per_moe_layer: int) -> int:
        """A MoE model's MLP blocks: ``per_moe_layer`` in each MoE layer, `dense_mlp` elsewhere."""
        dense = sum(lin.params for lin in self.dense_mlp)
        return self.moe_layers * per_moe_layer + (self.layers - self.moe_layers) * dense

    @property
    def params(self) -> int:
        """Exact total parameter count (tied weights counted once, every expert counted)."""
        outer = (self.embedding_params + self.lm_head_params + self.final_norm_params
                 + self.vision_params + self.extra_params)  # fmt: skip
        if self.blocks:
            return outer + sum(g.count * g.kind.params for g in self.blocks)
        moe = self._mlp_params(self.experts.layer_params) if self.experts else 0
        return (
            self.embedding_params
            + self.lm_head_params
            + self.layers * self.layer_params
            + self.final_norm_params
            + moe
            + self.vision_params
            + self.extra_params
        )

    @property
    def active_params(self) -> int:
        """Parameters one token uses (top-k routed experts; `params` for a dense model).

        The vision tower is left out: text training never runs it."""
        if self.blocks:
            inactive = sum(g.count * (g.kind.params - g.kind.active_params) for g in self.blocks)
            return self.params - self.vision_params - inactive
        if self.experts is None:
            return self.params - self.vision_params
        inactive = self.moe_layers * (self.experts.count - self.experts.top_k)
        return self.params - self.vision_params - inactive * self.experts.expert_params

    @property
    def quantizable_params(self) -> int:
        """Parameters that 4-bit QLoRA quantizes: the decoder's linear layers and, in a MoE
        model, the dense MLPs, shared experts and routed experts (the router stays 16-bit)."""
        if self.blocks:
            return sum(g.count * g.kind.quantizable_params for g in self.blocks)
        if self.experts is None:
            return self.layers * self.linear_params_per_layer
        shared = sum(lin.params for lin in self.experts.shared)
        per_moe_layer = self.experts.count * self.experts.expert_params + shared
        return self.layers * self.linear_params_per_layer + self._mlp_params(per_moe_layer)

    def lora_params(self, r: int, targets: str | list[str] = "all-linear") -> int:
        """Trainable LoRA parameters of a dense model: r·(d_in + d_out) per adapted linear, in
        every layer (what the planner counts for any model, MoE included, is
        `planning.memory.moe_memory.lora_param_count`)."""
        if self.blocks:
            names = None if targets == "all-linear" else set(targets)
            return sum(
                g.count * r * (lin.d_in + lin.d_out)
                for g in self.blocks for lin in g.kind.linears
                if names is None or lin.name in names or lin.name.split(".")[-1] in names
            )  # fmt: skip
        chosen = self.lora_targets(targets)
        return self.layers * sum(r * (lin.d_in + lin.d_out) for lin in chosen)

    def lora_targets(self, targets: str | list[str]) -> list[Linear]:
        """The decoder linears a LoRA target spec selects ("all-linear" or module names)."""
        if targets == "all-linear":
            return list(self.linears)
        names = set(targets)
        return [
            lin for lin in self.linears if lin.name.split(".")[-1] in names or lin.name in names
        ]

    def summary(self) -> dict[str, int]:
        """The `model` block of `plan --json` (without trainable_params)."""
        return {
            "params": self.params,
            "active_params": self.active_params,
            "layers": self.layers,
            "hidden": self.hidden,
            "vocab": self.vocab,
        }


def check_decoder(cfg: dict[str, Any], source: str, *, trust_remote_code: bool = False) -> str:
    """The config's ``model_type`` if it may be planned as a decoder; ModelSpecError naming it
    for an encoder-only or encoder-decoder model, a config without a model_type, and a model
    that needs its own code (``auto_map``) when the preset does not trust it."""
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelSpecError(
            f"{source}: no 'model_type'",
            hint='a Hugging Face config.json names its architecture, e.g. "model_type": "llama"',
        )
    if model_type in ENCODER_ONLY:
        raise ModelSpecError(
            f"{source}: model_type={model_type!r} is an encoder-only model", hint=DECODER_HINT
        )
    if cfg.get("is_encoder_decoder") or model_type in SEQ2SEQ:
        raise ModelSpecError(
            f"{source}: model_type={model_type!r} is an encoder-decoder (seq2seq) model",
            hint=DECODER_HINT,
        )
    if cfg.get("auto_map") and not trust_remote_code and model_type not in SUPPORTED:
        raise ModelSpecError(
            f"{source}: model_type={model_type!r} runs the model folder's own Python code "
            "(auto_map)",
            hint="set model.trust_remote_code = true in the preset if you trust that code",
        )
    return model_type


def spec_to_dict(spec: ModelSpec) -> dict[str, Any]:
    """The spec as JSON-ready values (the census's output and the spec cache's file)."""
    return asdict(spec)


MAX_SIZE = 10**12
"""The largest size a spec (or a config.json) may state: 10^12 is above any real width, vocabulary
or count; a larger one is damage or hostility, refused before arithmetic meets it."""
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
                         "sliding_window", "sliding_layers", "vision_params")}  # fmt: skip
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


def _get(cfg: dict[str, Any], *names: str, default: Any = None) -> Any:
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return default


def _require(cfg: dict[str, Any], source: str, *names: str) -> int:
    value = _get(cfg, *names)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ModelSpecError(
            f"{source}: missing or invalid {names[0]!r}",
            hint="config.json must be a Hugging Face model config with the model's sizes",
        )
    return value


def spec_from_config(cfg: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Build a ModelSpec from a parsed config.json. Raises ModelSpecError for unknown families."""
    model_type = str(cfg.get("model_type", "")).lower()
    if model_type not in SUPPORTED:
        known = ", ".join(SUPPORTED)
        raise ModelSpecError(
            f"{source}: unknown architecture model_type={model_type or None!r} "
            f"(architectures={cfg.get('architectures')})",
            hint=f"supported families: {known}",
        )
    if model_type == "gpt2":
        return _gpt2(cfg, source)
    if model_type == "phi3":
        return _phi3(cfg, source)
    if model_type in LLAMA_LIKE:
        return _llama_like(cfg, model_type, source)
    if model_type == "gemma3":
        return _gemma3_wrapper(cfg, source)
    if model_type == "deepseek_v2":
        return _deepseek_v2(cfg, source)
    if model_type in MOE_FAMILIES:
        return _moe(cfg, model_type, source)
    return _dense(cfg, model_type, source)


def _decoder_sizes(cfg: dict[str, Any], source: str) -> tuple[int, int, int, int, int, int, int]:
    """hidden, layers, heads, KV heads, intermediate, vocab and head_dim of a decoder config."""
    h = _require(cfg, source, "hidden_size")
    layers = _require(cfg, source, "num_hidden_layers")
    heads = _require(cfg, source, "num_attention_heads")
    kv = _get(cfg, "num_key_value_heads", default=heads)
    inter = _require(cfg, source, "intermediate_size")
    vocab = _require(cfg, source, "vocab_size")
    head_dim = _get(cfg, "head_dim", default=h // heads)
    return h, layers, heads, kv, inter, vocab, head_dim


def _decoder_spec(
    cfg: dict[str, Any],
    source: str,
    model_type: str,
    linears: tuple[Linear, ...],
    tied: bool,
    *,
    norms: int,
    other: int = 0,
    hidden_dropout: float = 0.0,
    embedding_dropout: float = 0.0,
) -> ModelSpec:
    """The ModelSpec of a decoder with token embeddings only (LLaMA-like families, Phi-3)."""
    h, layers, heads, kv, inter, vocab, head_dim = _decoder_sizes(cfg, source)
    return ModelSpec(
        model_type=model_type,
        layers=layers,
        hidden=h,
        heads=heads,
        kv_heads=kv,
        head_dim=head_dim,
        intermediate=inter,
        vocab=vocab,
        max_positions=int(_get(cfg, "max_position_embeddings", default=0) or 0),
        tied_embeddings=tied,
        linears=linears,
        embedding_params=vocab * h,
        lm_head_params=0 if tied else vocab * h,
        norm_params_per_layer=norms,
        final_norm_params=h,
        other_params_per_layer=other,
        source=source,
        attention_dropout=float(cfg.get("attention_dropout") or 0.0),
        hidden_dropout=hidden_dropout,
        embedding_dropout=embedding_dropout,
    )


def _llama_like(cfg: dict[str, Any], model_type: str, source: str) -> ModelSpec:
    h, layers, heads, kv, inter, vocab, head_dim = _decoder_sizes(cfg, source)
    # Gemma always ties; the others follow the config (transformers' default is True for
    # Qwen2/Qwen3/Gemma configs and False for LLaMA/Mistral).
    tie_default = model_type in ("qwen2", "qwen3", "gemma", "gemma2")
    tied = bool(_get(cfg, "tie_word_embeddings", default=tie_default))
    if model_type == "qwen2":
        qkv_bias, o_bias, mlp_bias = True, False, False
    elif model_type in ("llama",):
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))
    elif model_type in ("qwen3", "gemma", "gemma2"):
        qkv_bias = o_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = False
    else:  # mistral
        qkv_bias = o_bias = mlp_bias = False
    linears = (
        Linear("self_attn.q_proj", h, heads * head_dim, qkv_bias),
        Linear("self_attn.k_proj", h, kv * head_dim, qkv_bias),
        Linear("self_attn.v_proj", h, kv * head_dim, qkv_bias),
        Linear("self_attn.o_proj", heads * head_dim, h, o_bias),
        Linear("mlp.gate_proj", h, inter, mlp_bias),
        Linear("mlp.up_proj", h, inter, mlp_bias),
        Linear("mlp.down_proj", inter, h, mlp_bias),
    )
    norms = 4 * h if model_type == "gemma2" else 2 * h
    other = 2 * head_dim if model_type == "qwen3" else 0  # q_norm and k_norm
    spec = _decoder_spec(cfg, source, model_type, linears, tied, norms=norms, other=other)
    if model_type == "gemma2":  # soft-capped logits, sliding window on every other layer
        return replace(
            spec,
            full_logits=cfg.get("final_logit_softcapping") is not None,
            sliding_window=int(cfg.get("sliding_window") or 0),
            sliding_layers=_sliding_layers(cfg, spec.layers, pattern=2)
            if cfg.get("sliding_window")
            else 0,
        )
    return spec


def _phi3(cfg: dict[str, Any], source: str) -> ModelSpec:
    h, layers, heads, kv, inter, vocab, head_dim = _decoder_sizes(cfg, source)
    tied = bool(cfg.get("tie_word_embeddings", False))
    linears = (
        Linear("self_attn.qkv_proj", h, heads * head_dim + 2 * kv * head_dim),
        Linear("self_attn.o_proj", heads * head_dim, h),
        Linear("mlp.gate_up_proj", h, 2 * inter),
        Linear("mlp.down_proj", inter, h),
    )
    return _decoder_spec(
        cfg, source, "phi3", linears, tied, norms=2 * h,
        hidden_dropout=float(cfg.get("resid_pdrop") or 0.0),
        embedding_dropout=float(cfg.get("embd_pdrop") or 0.0),
    )  # fmt: skip


def _gpt2(cfg: dict[str, Any], source: str) -> ModelSpec:
    h = _require(cfg, source, "n_embd", "hidden_size")
    layers = _require(cfg, source, "n_layer", "num_hidden_layers")
    heads = _require(cfg, source, "n_head", "num_attention_heads")
    vocab = _require(cfg, source, "vocab_size")
    positions = _require(cfg, source, "n_positions", "max_position_embeddings")
    inner = _get(cfg, "n_inner", default=None) or 4 * h
    linears = (
        Linear("attn.c_attn", h, 3 * h, True),
        Linear("attn.c_proj", h, h, True),
        Linear("mlp.c_fc", h, inner, True),
        Linear("mlp.c_proj", inner, h, True),
    )
    return ModelSpec(
        model_type="gpt2",
        layers=layers,
        hidden=h,
        heads=heads,
        kv_heads=heads,
        head_dim=h // heads,
        intermediate=inner,
        vocab=vocab,
        max_positions=positions,
        tied_embeddings=True,  # GPT2LMHeadModel always ties lm_head to wte
        linears=linears,
        embedding_params=vocab * h + positions * h,
        lm_head_params=0,
        norm_params_per_layer=4 * h,  # ln_1 and ln_2, weight and bias
        final_norm_params=2 * h,
        source=source,
        # transformers' GPT2Config defaults, which every released GPT-2 keeps.
        attention_dropout=float(_get(cfg, "attn_pdrop", default=0.1)),
        hidden_dropout=float(_get(cfg, "resid_pdrop", default=0.1)),
        embedding_dropout=float(_get(cfg, "embd_pdrop", default=0.1)),
    )


# --- Families added for issue 23: defaults are transformers 5's config-class defaults, so a
# config.json that leaves a field out is counted as transformers would build it.

# Per family: head_dim default (None: hidden // heads), tied default, q/k/v bias field and
# default, o bias follows it, MLP bias field, norms per layer (multiples of hidden).
_DENSE_RULES: dict[str, dict[str, Any]] = {
    "gemma3_text": {"head_dim": 256, "tied": True, "bias": ("attention_bias", False),
                    "o_bias": True, "mlp_bias": None, "norms": 4, "qk_norm": "head"},
    "olmo2": {"head_dim": None, "tied": False, "bias": ("attention_bias", False),
              "o_bias": True, "mlp_bias": None, "norms": 2, "qk_norm": "full"},
    "granite": {"head_dim": None, "tied": False, "bias": ("attention_bias", False),
                "o_bias": True, "mlp_bias": "mlp_bias", "norms": 2, "qk_norm": None},
    "smollm3": {"head_dim": None, "tied": True, "bias": ("attention_bias", False),
                "o_bias": True, "mlp_bias": "mlp_bias", "norms": 2, "qk_norm": None},
    "glm4": {"head_dim": 128, "tied": False, "bias": ("attention_bias", True),
             "o_bias": False, "mlp_bias": None, "norms": 4, "qk_norm": None, "fused_mlp": True},
    "qwen3_moe": {"head_dim": None, "tied": False, "bias": ("attention_bias", False),
                  "o_bias": True, "norms": 2, "qk_norm": "head"},
    "qwen2_moe": {"head_dim": None, "tied": False, "bias": ("qkv_bias", True),
                  "o_bias": False, "norms": 2, "qk_norm": None},
    "olmoe": {"head_dim": None, "tied": False, "bias": ("attention_bias", False),
              "o_bias": True, "norms": 2, "qk_norm": "full"},
    "mixtral": {"head_dim": None, "tied": False, "bias": (None, False),
                "o_bias": True, "norms": 2, "qk_norm": None},
    "gpt_oss": {"head_dim": 64, "tied": False, "bias": ("attention_bias", True),
                "o_bias": True, "norms": 2, "qk_norm": None},
}  # fmt: skip


def _attention(
    h: int, heads: int, kv: int, head_dim: int, bias: bool, o_bias: bool
) -> tuple[Linear, ...]:
    return (
        Linear("self_attn.q_proj", h, heads * head_dim, bias),
        Linear("self_attn.k_proj", h, kv * head_dim, bias),
        Linear("self_attn.v_proj", h, kv * head_dim, bias),
        Linear("self_attn.o_proj", heads * head_dim, h, o_bias),
    )


def _swiglu(
    prefix: str, h: int, inter: int, bias: bool = False, fused: bool = False
) -> tuple[Linear, ...]:
    if fused:
        return (
            Linear(f"{prefix}.gate_up_proj", h, 2 * inter, bias),
            Linear(f"{prefix}.down_proj", inter, h, bias),
        )
    return (
        Linear(f"{prefix}.gate_proj", h, inter, bias),
        Linear(f"{prefix}.up_proj", h, inter, bias),
        Linear(f"{prefix}.down_proj", inter, h, bias),
    )  # fmt: skip


def _sliding_layers(cfg: dict[str, Any], layers: int, pattern: int) -> int:
    """Layers with sliding-window attention: ``layer_types`` if given, else every layer but each
    ``pattern``-th (transformers' default layer types for Gemma 2/3 and gpt-oss)."""
    types = cfg.get("layer_types")
    if isinstance(types, list):
        return sum(1 for t in types if t == "sliding_attention")
    pattern = int(cfg.get("sliding_window_pattern") or pattern)
    return layers - layers // pattern  # every layer but each pattern-th


def _family_base(
    cfg: dict[str, Any], model_type: str, source: str, mlp: tuple[Linear, ...] | None
) -> ModelSpec:
    """Attention, norms and embeddings of a `_DENSE_RULES` family; ``mlp`` None: the dense MLP."""
    rule = _DENSE_RULES[model_type]
    h = _require(cfg, source, "hidden_size")
    heads = _require(cfg, source, "num_attention_heads")
    kv = _get(cfg, "num_key_value_heads", default=heads)
    head_dim = _get(cfg, "head_dim", default=rule["head_dim"] or h // heads)
    field, default = rule["bias"]
    bias = bool(_get(cfg, field, default=default)) if field else default
    linears = _attention(h, heads, kv, head_dim, bias, bias and rule["o_bias"])
    if mlp is None:
        inter = _require(cfg, source, "intermediate_size")
        mlp_bias = bool(cfg.get(rule["mlp_bias"], False)) if rule.get("mlp_bias") else False
        mlp = _swiglu("mlp", h, inter, mlp_bias, rule.get("fused_mlp", False))
    qk_norm = {"head": 2 * head_dim, "full": (heads + kv) * head_dim, None: 0}[rule["qk_norm"]]
    tied = bool(_get(cfg, "tie_word_embeddings", default=rule["tied"]))
    if "intermediate_size" not in cfg:  # MoE families: the planner's `intermediate` is the expert's
        cfg = {**cfg, "intermediate_size": _get(cfg, "moe_intermediate_size", default=1)}
    return _decoder_spec(
        cfg, source, model_type, linears + mlp, tied, norms=rule["norms"] * h, other=qk_norm
    )


def _dense(cfg: dict[str, Any], model_type: str, source: str) -> ModelSpec:
    """Gemma 3 text, OLMo 2, Granite, SmolLM3, GLM-4: LLaMA-like decoders with their own norms."""
    spec = _family_base(cfg, model_type, source, None)
    window = int(cfg.get("sliding_window") or 0)
    sliding = 0
    if model_type == "gemma3_text" and window:
        sliding = _sliding_layers(cfg, spec.layers, pattern=6)
    elif model_type == "smollm3" and window and cfg.get("use_sliding_window"):
        sliding = sum(1 for t in cfg.get("layer_types") or [] if t == "sliding_attention")
    full_logits = (
        (model_type == "gemma3_text" and cfg.get("final_logit_softcapping") is not None)
        or (model_type == "granite" and float(cfg.get("logits_scaling", 1.0) or 1.0) != 1.0)
    )  # fmt: skip
    return replace(
        spec,
        sliding_window=window if sliding else 0,
        sliding_layers=sliding,
        full_logits=full_logits,
    )


def _moe_layer_count(cfg: dict[str, Any], layers: int) -> int:
    """Qwen-MoE's rule: MoE unless in ``mlp_only_layers`` or off the ``decoder_sparse_step``."""
    only = {i for i in cfg.get("mlp_only_layers") or [] if 0 <= i < layers}
    step = int(cfg.get("decoder_sparse_step") or 1)
    return layers // step - sum(1 for i in only if (i + 1) % step == 0)


def _moe(cfg: dict[str, Any], model_type: str, source: str) -> ModelSpec:
    """Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, gpt-oss: attention as their dense kin, fused experts."""
    h = _require(cfg, source, "hidden_size")
    count_default = {"qwen3_moe": 128, "qwen2_moe": 60, "olmoe": 64, "mixtral": 8, "gpt_oss": 128}
    count = int(_get(cfg, "num_experts", "num_local_experts", default=count_default[model_type]))
    top_k = int(
        _get(
            cfg,
            "num_experts_per_tok",
            default={"qwen3_moe": 8, "qwen2_moe": 4, "olmoe": 8}.get(
                model_type, 2 if model_type == "mixtral" else 4
            ),
        )
    )
    if model_type in ("qwen3_moe", "qwen2_moe"):
        inter = int(
            _get(cfg, "moe_intermediate_size", default=768 if model_type == "qwen3_moe" else 1408)
        )
    else:
        inter = _require(cfg, source, "intermediate_size")
    bias = model_type == "gpt_oss"  # gpt-oss's experts and router carry biases
    expert = _swiglu("mlp.experts", h, inter, bias, fused=True)
    spec = _family_base(cfg, model_type, source, mlp=())
    moe_layers, dense_mlp, shared, shared_gate = spec.layers, (), (), 0
    if model_type in ("qwen3_moe", "qwen2_moe"):
        moe_layers = _moe_layer_count(cfg, spec.layers) if count > 0 else 0
        dense_mlp = _swiglu("mlp", h, _require(cfg, source, "intermediate_size"))
    if model_type == "qwen2_moe":
        shared = _swiglu(
            "mlp.shared_expert", h, int(_get(cfg, "shared_expert_intermediate_size", default=5632))
        )
        shared_gate = h
    coef = float(
        _get(cfg, "router_aux_loss_coef", default=0.01 if model_type == "olmoe" else 0.001)
    )
    experts = Experts(
        count=count, top_k=top_k, linears=expert, layers=moe_layers, fused=True,
        router_params=count * h + (count if bias else 0), shared=shared,
        shared_gate_params=shared_gate, aux_loss_coef=coef,
    )  # fmt: skip
    sinks = spec.heads if model_type == "gpt_oss" else 0  # gpt-oss's attention sinks, per head
    window = int(cfg.get("sliding_window") or 0) if model_type in ("gpt_oss", "mixtral") else 0
    if model_type == "gpt_oss":
        window = int(_get(cfg, "sliding_window", default=128))
        sliding = _sliding_layers(cfg, spec.layers, pattern=2) if window else 0
    else:
        sliding = spec.layers if window else 0
    return replace(
        spec, experts=experts, dense_mlp=dense_mlp, intermediate=inter,
        other_params_per_layer=spec.other_params_per_layer + sinks,
        sliding_window=window if sliding else 0, sliding_layers=sliding,
        quantization=_quant_method(cfg),
    )  # fmt: skip


def _quant_method(cfg: dict[str, Any]) -> str | None:
    quant = cfg.get("quantization_config")
    return str(quant.get("quant_method") or "unknown") if isinstance(quant, dict) else None


def _deepseek_v2(cfg: dict[str, Any], source: str) -> ModelSpec:
    """DeepSeek-V2: multi-head latent attention, shared experts, ``first_k_dense_replace``."""
    h = _require(cfg, source, "hidden_size")
    layers = _require(cfg, source, "num_hidden_layers")
    heads = _require(cfg, source, "num_attention_heads")
    inter = _require(cfg, source, "intermediate_size")
    top_k = _require(cfg, source, "num_experts_per_tok")
    q_rank = cfg.get("q_lora_rank", 1536)
    kv_rank = int(_get(cfg, "kv_lora_rank", default=512))
    nope, rope = (
        int(_get(cfg, "qk_nope_head_dim", default=128)),
        int(_get(cfg, "qk_rope_head_dim", default=64)),
    )
    v_dim = int(_get(cfg, "v_head_dim", default=128))
    bias, mlp_bias = bool(cfg.get("attention_bias", False)), bool(cfg.get("mlp_bias", False))
    qk = nope + rope
    if q_rank:
        q: tuple[Linear, ...] = (
            Linear("self_attn.q_a_proj", h, q_rank, bias),
            Linear("self_attn.q_b_proj", q_rank, heads * qk),
        )
    else:
        q = (Linear("self_attn.q_proj", h, heads * qk),)
    linears = (
        *q,
        Linear("self_attn.kv_a_proj_with_mqa", h, kv_rank + rope, bias),
        Linear("self_attn.kv_b_proj", kv_rank, heads * (nope + v_dim)),
        Linear("self_attn.o_proj", heads * v_dim, h, bias),
    )  # fmt: skip
    count = int(_get(cfg, "n_routed_experts", default=64))
    moe_inter = int(_get(cfg, "moe_intermediate_size", default=1407))
    n_shared = int(_get(cfg, "n_shared_experts", default=2) or 0)
    dense_layers = min(layers, int(cfg.get("first_k_dense_replace") or 0))
    experts = Experts(
        count=count, top_k=top_k, linears=_swiglu("mlp.experts", h, moe_inter, fused=True),
        layers=layers - dense_layers, router_params=count * h,
        shared=_swiglu("mlp.shared_experts", h, moe_inter * n_shared, mlp_bias) if n_shared else (),
        aux_loss_coef=float(_get(cfg, "router_aux_loss_coef", "aux_loss_alpha", default=0.0)),
    )  # fmt: skip
    tied = bool(cfg.get("tie_word_embeddings", False))
    # The KV cache holds keys and values expanded per head (transformers' eager MLA).
    spec = _decoder_spec({**cfg, "head_dim": qk}, source, "deepseek_v2", linears, tied, norms=2 * h,
                         other=kv_rank + (q_rank or 0))  # fmt: skip
    return replace(
        spec, experts=experts, dense_mlp=_swiglu("mlp", h, inter, mlp_bias), intermediate=moe_inter,
        quantization=_quant_method(cfg),
    )  # fmt: skip


# SigLIP's vision config defaults (transformers 5), for a wrapper's vision_config.
_SIGLIP = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
           "image_size": 224, "patch_size": 16, "num_channels": 3, "vision_use_head": True}  # fmt: skip


def _siglip_params(vision: dict[str, Any]) -> int:
    """A SigLIP vision tower: patch and position embeddings, encoder layers, post-norm, head."""
    v = {**_SIGLIP, **{k: val for k, val in vision.items() if val is not None}}
    d, i, p = int(v["hidden_size"]), int(v["intermediate_size"]), int(v["patch_size"])
    embed = v["num_channels"] * p * p * d + d + (int(v["image_size"]) // p) ** 2 * d
    mlp = d * i + i + i * d + d
    layer = 2 * 2 * d + 4 * (d * d + d) + mlp
    head = (d + 3 * d * d + 3 * d + d * d + d + 2 * d + mlp) if v["vision_use_head"] else 0
    return embed + int(v["num_hidden_layers"]) * layer + 2 * d + head


def _gemma3_wrapper(cfg: dict[str, Any], source: str) -> ModelSpec:
    """Gemma 3 with its SigLIP tower (Gemma3ForConditionalGeneration): the text model's spec
    plus the vision tower and the projector in `vision_params`."""
    text = {"model_type": "gemma3_text", **(cfg.get("text_config") or {})}
    text["tie_word_embeddings"] = cfg.get("tie_word_embeddings", True)
    for name, value in (
        ("hidden_size", 2304),
        ("num_hidden_layers", 26),
        ("intermediate_size", 9216),
        ("num_attention_heads", 8),
        ("num_key_value_heads", 4),
        ("vocab_size", 262_208),
    ):
        text.setdefault(name, value)  # Gemma3TextConfig's defaults
    spec = _dense(text, "gemma3_text", source)
    vision = cfg.get("vision_config") or {}
    vision_h = int(vision.get("hidden_size") or _SIGLIP["hidden_size"])
    projector = vision_h * spec.hidden + vision_h  # projection weight and its soft-embedding norm
    return replace(spec, model_type="gemma3", vision_params=_siglip_params(vision) + projector)  # fmt: skip


CONFIG_MAX_BYTES = 16 * 1024 * 1024
"""The largest config.json read (released ones are a few KB; a Gemma 4 or Qwen3.5 with its
per-layer lists a few tens of KB)."""
CONFIG_MAX_DEPTH = 32
"""The deepest nesting of objects and lists a config.json may have (released ones: 3 or 4)."""

_K, _M = 1 << 10, 1 << 20
# Sizes a config.json states, by field: (smallest, largest). None (or absent) is left to the
# family's default; anything else must be an integer (not a bool, not a float) in range.
CONFIG_INTS: dict[str, tuple[int, int]] = {
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers"), (1, MAX_LAYERS)),
    **dict.fromkeys(("hidden_size", "n_embd", "d_model"), (1, _M)),
    **dict.fromkeys(("num_attention_heads", "n_head", "num_key_value_heads",
                     "linear_num_key_heads", "linear_num_value_heads", "mamba_n_heads",
                     "mamba_num_heads", "num_heads"), (1, 64 * _K)),
    **dict.fromkeys(("head_dim", "linear_key_head_dim", "linear_value_head_dim", "mamba_d_head",
                     "mamba_head_dim", "global_head_dim", "v_head_dim", "attention_head_dim"),
                    (1, 64 * _K)),
    **dict.fromkeys(("qk_rope_head_dim", "qk_nope_head_dim", "q_lora_rank", "kv_lora_rank",
                     "first_k_dense_replace", "num_kv_shared_layers", "num_nextn_predict_layers",
                     "mtp_num_hidden_layers", "sliding_window", "attention_chunk_size",
                     "shared_expert_intermediate_size", "n_shared_experts",
                     "moe_shared_expert_intermediate_size", "hidden_size_per_layer_input"),
                    (0, 64 * _M)),
    **dict.fromkeys(("intermediate_size", "moe_intermediate_size", "n_inner", "ffn_hidden_size",
                     "mamba_d_ssm", "mamba_expand"), (1, 64 * _M)),
    **dict.fromkeys(("vocab_size", "vocab_size_per_layer_input"), (1, 64 * _M)),
    **dict.fromkeys(("max_position_embeddings", "n_positions"), (1, 1 << 30)),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"),
                    (1, 64 * _K)),
    **dict.fromkeys(("num_experts_per_tok", "top_k_experts", "moe_k", "moe_topk"), (1, 64 * _K)),
    **dict.fromkeys(("ssm_state_size", "mamba_d_state", "n_groups", "mamba_n_groups",
                     "linear_conv_kernel_dim", "mamba_d_conv", "conv_kernel", "conv_L_cache",
                     "decoder_sparse_step", "mamba_chunk_size", "chunk_size"), (1, 64 * _K)),
    **dict.fromkeys(("sliding_window_pattern", "attn_layer_period", "expert_layer_period",
                     "moe_layer_interval"), (1, MAX_LAYERS)),
    **dict.fromkeys(("attn_layer_offset", "expert_layer_offset", "moe_layer_start_index"),
                    (0, MAX_LAYERS)),
}  # fmt: skip
CONFIG_FLOATS = ("attention_dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop", "hidden_dropout",
                 "router_aux_loss_coef", "aux_loss_alpha", "logits_scaling",
                 "final_logit_softcapping", "attn_logit_softcapping")  # fmt: skip
"""Numbers a config.json states that the planner reads: a number (not a string), finite."""
PER_LAYER_INTS = frozenset({"intermediate_size", "num_key_value_heads", "num_attention_heads",
                            "head_dim", "sliding_window"})  # fmt: skip
"""Sizes a family may give per layer, as a list (Gemma 3n's intermediate_size)."""
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_FIELDS = ("num_experts_per_tok", "top_k_experts", "moe_k", "moe_topk")
LAYER_LISTS = ("layer_types", "layers_block_type", "mlp_only_layers", "full_attn_idxs",
               "block_types", "attn_layer_indices")  # fmt: skip


def _config_error(source: str, field: str, why: str) -> ModelSpecError:
    return ModelSpecError(
        f"{source}: {field}: {why}",
        hint="config.json must be the model's published Hugging Face config; re-download it",
    )


def _walk_config(cfg: Any, source: str) -> None:
    """Every value of a parsed config: no deeper than `CONFIG_MAX_DEPTH`, every number finite
    (no Infinity or NaN), no integer longer than 30 digits (iterative: no recursion to blow)."""
    stack: list[tuple[Any, str, int]] = [(cfg, "", 0)]
    while stack:
        value, where, depth = stack.pop()
        if depth > CONFIG_MAX_DEPTH:
            raise _config_error(
                source, where or "(top)", f"nested over {CONFIG_MAX_DEPTH} levels deep"
            )
        if isinstance(value, dict):
            stack += [(v, f"{where}.{k}" if where else str(k), depth + 1) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(v, f"{where}[{i}]", depth + 1) for i, v in enumerate(value)]
        elif isinstance(value, float) and not math.isfinite(value):
            raise _config_error(source, where, f"{value} is not a finite number")
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10**30:
            raise _config_error(source, where, "an integer of more than 30 digits")


def check_config_sizes(cfg: dict[str, Any], source: str, where: str = "") -> None:
    """ModelSpecError naming config.json and the field for a size no model has: a wrong type, a
    zero or negative count of layers, heads, head dims or experts, a top-k above the experts,
    more than `MAX_LAYERS` layers, a per-layer list of another length. Checked before anything
    uses them (the hand-written spec, the census child, the worker)."""
    for name, (low, high) in CONFIG_INTS.items():
        value = cfg.get(name)
        if value is None:
            continue
        if isinstance(value, list) and name in PER_LAYER_INTS:  # one size per layer (Gemma 3n)
            if len(value) > MAX_LAYERS or not all(
                isinstance(v, int) and not isinstance(v, bool) and low <= v <= high for v in value
            ):
                raise _config_error(source, where + name, f"must list integers in [{low}, {high}]")
            continue
        if not isinstance(value, int) or isinstance(value, bool):
            got = type(value).__name__
            raise _config_error(
                source, where + name, f"must be an integer, got {got} {str(value)[:40]!r}"
            )
        if not low <= value <= high:
            raise _config_error(source, where + name, f"{value} is outside [{low}, {high}]")
    for name in CONFIG_FLOATS:
        value = cfg.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float)
                                  or not -1e6 <= value <= 1e6):  # fmt: skip
            raise _config_error(source, where + name, f"must be a number, got {str(value)[:40]!r}")
    count = next((cfg[n] for n in EXPERT_COUNTS if cfg.get(n) is not None), None)
    top_k = next((n for n in TOP_K_FIELDS if cfg.get(n) is not None), None)
    zero = cfg.get("zero_expert_num") if isinstance(cfg.get("zero_expert_num"), int) else 0
    if count is not None and top_k is not None and cfg[top_k] > count + max(0, zero):
        raise _config_error(source, where + top_k, f"{cfg[top_k]} is above the {count} experts")
    layers = next((cfg[n] for n in ("num_hidden_layers", "n_layer", "num_layers")
                   if cfg.get(n) is not None), None)  # fmt: skip
    for name in LAYER_LISTS:
        value = cfg.get(name)
        if value is None:
            continue
        if not isinstance(value, list) or len(value) > MAX_LAYERS:
            raise _config_error(
                source, where + name, f"must be a list of at most {MAX_LAYERS} items"
            )
        if name == "block_types":  # a pattern repeated over the layers (RecurrentGemma)
            if not all(isinstance(t, str) for t in value):
                raise _config_error(source, where + name, "must name layer types")
        elif name in ("layer_types", "layers_block_type") and layers is not None:
            if len(value) != layers or not all(isinstance(t, str) for t in value):
                raise _config_error(
                    source, where + name, f"must name one layer type per layer ({layers})"
                )
        elif name not in ("layer_types", "layers_block_type", "block_types") and not all(
            isinstance(i, int) and not isinstance(i, bool) and 0 <= i < MAX_LAYERS for i in value
        ):
            raise _config_error(source, where + name, "must list layer indices")
    pattern = cfg.get("hybrid_override_pattern")
    if pattern is not None and (not isinstance(pattern, str) or len(pattern) > MAX_LAYERS):
        raise _config_error(source, where + "hybrid_override_pattern", "must be a short string")
    hidden = next((cfg[n] for n in ("hidden_size", "n_embd") if cfg.get(n) is not None), None)
    heads = next(
        (cfg[n] for n in ("num_attention_heads", "n_head") if cfg.get(n) is not None), None
    )
    heads = heads if isinstance(heads, int) else None  # a per-layer list: transformers checks
    if hidden and heads and cfg.get("head_dim") is None and heads > hidden:
        raise _config_error(
            source, where + "num_attention_heads", f"{heads} heads of a {hidden}-wide model"
        )
    kv = cfg.get("num_key_value_heads")
    if heads and isinstance(kv, int) and kv > heads:
        raise _config_error(
            source, where + "num_key_value_heads", f"{kv} is above the {heads} heads"
        )
    for name in ("text_config", "language_config", "llm_config"):
        if isinstance(cfg.get(name), dict):
            check_config_sizes(cfg[name], source, f"{where}{name}.")


def read_regular_file(path: Path, limit: int, what: str) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``limit`` bytes (a FIFO, a device
    such as /dev/zero or a folder is refused without reading: no hang, no unbounded read);
    ModelSpecError naming it otherwise. OSError passes through for a missing file."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ModelSpecError(f"{path}: not a regular file", hint=f"{what} must be a plain file")
        if st.st_size > limit:
            raise ModelSpecError(
                f"{path}: {st.st_size} bytes, over the {limit} a {what} may have",
                hint=f"{what} must be the model's published file",
            )
        chunks, size = [], 0
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise ModelSpecError(
                    f"{path}: grew past {limit} bytes", hint=f"{what} must be a plain file"
                )
        return b"".join(chunks)
    finally:
        os.close(fd)


def parse_config(data: bytes, path: Path | str) -> dict[str, Any]:
    """A config.json's bytes parsed and checked (`check_config_sizes`), errors naming the file."""
    try:
        cfg = json.loads(data.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelSpecError(
            f"{path}: not valid JSON ({exc})", hint="re-download or re-save the model's config"
        ) from None
    except (ValueError, RecursionError) as exc:  # a 5,000-digit integer; nesting past the C stack
        why = "nested too deep" if isinstance(exc, RecursionError) else str(exc).split(";")[0]
        raise ModelSpecError(
            f"{path}: not a model config ({why})", hint="re-download or re-save the model's config"
        ) from None
    if not isinstance(cfg, dict):
        raise ModelSpecError(f"{path}: expected a JSON object", hint="a config.json is an object")
    _walk_config(cfg, str(path))
    check_config_sizes(cfg, str(path))
    return cfg


def read_config_bytes(model_dir: str | Path) -> tuple[Path, bytes]:
    """A model folder's config.json path and bytes (a regular file, size-bounded)."""
    folder = Path(model_dir)
    if not folder.is_dir():
        raise ModelSpecError(
            f"model.path: {folder} is not a folder",
            hint="model.path must be a local Hugging Face model folder (with config.json)",
        )
    path = folder / "config.json"
    try:
        return path, read_regular_file(path, CONFIG_MAX_BYTES, "config.json")
    except FileNotFoundError:
        raise ModelSpecError(
            f"{path}: missing",
            hint="a Hugging Face model folder has config.json beside the weights and tokenizer",
        ) from None
    except OSError as exc:
        raise ModelSpecError(
            f"{path}: cannot be read ({exc.strerror})", hint="check its permissions"
        ) from None


def read_config(model_dir: str | Path) -> dict[str, Any]:
    """Read a model folder's config.json with errors that name the file and the field."""
    path, data = read_config_bytes(model_dir)
    cfg = parse_config(data, path)
    # Multimodal wrappers keep the text model's sizes in text_config.
    if "text_config" in cfg and isinstance(cfg["text_config"], dict) and "model_type" not in cfg:
        cfg = cfg["text_config"]
    return cfg


def hand_written_spec(
    model_dir: str | Path, *, trust_remote_code: bool = False, text_only: bool = False
) -> ModelSpec | None:
    """The spec of a hand-written family from config.json (None: another decoder, to derive
    from transformers' module tree); ModelSpecError for a model that cannot be planned.

    ``text_only``: a multimodal wrapper's language model alone (its ``text_config``)."""
    source = str(Path(model_dir) / "config.json")
    cfg = read_config(model_dir)
    check_decoder(cfg, source, trust_remote_code=trust_remote_code)
    text = cfg.get("text_config")
    if text_only and isinstance(text, dict):
        # Gemma 3's text_config names no model_type; the tie is the wrapper's.
        default_type = "gemma3_text" if cfg.get("model_type") == "gemma3" else None
        text = {"model_type": default_type, **text}
        text.setdefault("tie_word_embeddings", cfg.get("tie_word_embeddings", True))
        return spec_from_config(text, source) if text["model_type"] in SUPPORTED else None
    return spec_from_config(cfg, source) if str(cfg["model_type"]).lower() in SUPPORTED else None


def load_model_spec(model_dir: str | Path) -> ModelSpec:
    """The ModelSpec of a local model folder, from its config.json alone."""
    cfg = read_config(model_dir)
    return spec_from_config(cfg, source=str(Path(model_dir) / "config.json"))
