"""Model shape and exact parameter count from a Hugging Face `config.json` alone (no torch).

Hand-written families (`SUPPORTED`): dense LLaMA, Mistral, Qwen2, Qwen3, Gemma, Gemma2,
Gemma3 (text and the vision wrapper), OLMo2, Granite, SmolLM3, GLM-4, Phi-3 and GPT-2, and the
Mixture-of-Experts Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral, gpt-oss and DeepSeek-V2. The counts
match instantiating the model through transformers 5 on the meta device, parameter for
parameter (the tests check it). Other decoders are derived from transformers' module tree
(`train/model/model_census.py`, read back by `planning.spec_document.spec_from_dict`). The layer
types are in `planning.model_layers`, the reading and checking of config.json in
`planning.model_config`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from homelab_dp.errors import ModelSpecError

# Re-exported: the layer types and the config reader are part of this module's interface.
from homelab_dp.planning.model_config import CONFIG_INTS
from homelab_dp.planning.model_config import MAX_LAYERS as MAX_LAYERS
from homelab_dp.planning.model_config import read_config as read_config
from homelab_dp.planning.model_layers import ATTENTION_KINDS as ATTENTION_KINDS
from homelab_dp.planning.model_layers import MIXER_KINDS as MIXER_KINDS
from homelab_dp.planning.model_layers import STATE_KINDS as STATE_KINDS
from homelab_dp.planning.model_layers import Experts as Experts
from homelab_dp.planning.model_layers import LayerGroup as LayerGroup
from homelab_dp.planning.model_layers import LayerKind as LayerKind
from homelab_dp.planning.model_layers import Linear as Linear
from homelab_dp.planning.model_layers import Mixer as Mixer
from homelab_dp.planning.model_layers import lora_can_adapt as lora_can_adapt
from homelab_dp.planning.model_layers import nf4_weights
from homelab_dp.planning.vision_towers import SIGLIP, siglip_linear_weights, siglip_params

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
NOT_CAUSAL = {
    "xlm": "a cross-lingual masked language model (its causal head is a side mode)",
    "xlnet": "a permutation language model (two-stream attention)",
}
"""Language models transformers builds as causal LMs that were not trained left to right."""
SEQ2SEQ = frozenset({
    "t5", "mt5", "umt5", "longt5", "bart", "mbart", "pegasus", "pegasus_x", "marian",
    "blenderbot", "blenderbot-small", "led", "plbart", "bigbird_pegasus", "prophetnet",
    "switch_transformers", "fsmt", "m2m_100", "nllb-moe", "mvp", "whisper", "t5gemma",
})  # fmt: skip
DECODER_HINT = (
    "homelab-dp fine-tunes decoder-only causal language models (llama, qwen3, mistral, gemma3, ...)"
)


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

    outer_quantized: int = 0
    """Weights of the ``nn.Linear`` modules outside the decoder layers that QLoRA quantizes
    (Gemma 4's ``per_layer_model_projection``, a vision tower's linears; not the output layer
    nor what `model_layers.nf4_skip_modules` keeps): counted by the census on the built model,
    already inside `params` (`extras`, `final_norm_params`, `vision_params`)."""

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
        """Parameters that 4-bit QLoRA quantizes: the weights of the decoder's linear layers
        and, in a MoE model, of the dense MLPs, shared experts and routed experts, plus the
        linears outside the layers that it quantizes (`outer_quantized`). What the family keeps
        16-bit is left out (`model_layers.nf4_skip_modules`, the rule the worker loads by:
        routers, Mamba's ``out_proj`` on the families whose fused kernel reads it), and so are
        biases (bitsandbytes keeps them 16-bit)."""
        if self.blocks:
            inner = sum(g.count * g.kind.quantized_params(self.model_type) for g in self.blocks)
            return inner + self.outer_quantized
        mt, e = self.model_type, self.experts
        inner = self.layers * nf4_weights(mt, self.linears)
        if e is not None:
            moe = e.count * e.expert_weights + nf4_weights(mt, e.shared)
            dense = (self.layers - self.moe_layers) * nf4_weights(mt, self.dense_mlp)
            inner += self.moe_layers * moe + dense
        return inner + self.outer_quantized

    def lora_params(self, r: int, targets: str | list[str] = "all-linear") -> int:
        """Trainable LoRA parameters of a dense model: r·(d_in + d_out) per adapted linear, in
        every layer (what the planner counts for any model, MoE included, is
        `planning.memory.moe_memory.lora_param_count`)."""
        if self.blocks:
            names = None if targets == "all-linear" else set(targets)
            return sum(
                g.count * r * (lin.d_in + lin.d_out)
                for g in self.blocks for lin in g.kind.linears
                if (names is None or lin.name in names or lin.name.split(".")[-1] in names)
                and lora_can_adapt(self.model_type, lin.name)
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

    def summary(self) -> dict[str, Any]:
        """The `model` block of `plan --json` (without trainable_params); a model of layer
        groups adds its layers per mixer kind and how many carry a recurrent state."""
        out: dict[str, Any] = {
            "params": self.params,
            "active_params": self.active_params,
            "layers": self.layers,
            "hidden": self.hidden,
            "vocab": self.vocab,
        }
        if self.blocks:
            out["layers_by_kind"] = self.mixer_counts
            out["state_layers"] = self.state_layers
        return out


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
    if model_type in NOT_CAUSAL:
        raise ModelSpecError(
            f"{source}: model_type={model_type!r} is {NOT_CAUSAL[model_type]}, not a causal decoder",
            hint=DECODER_HINT,
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
    listed = next((n for n in CONFIG_INTS if isinstance(cfg.get(n), list)), None)
    if listed is not None:  # the hand-written families take one number per size
        raise ModelSpecError(
            f"{source}: {listed}: must be one integer for model_type={model_type!r}, got a list",
            hint="config.json must be the model's published Hugging Face config; re-download it",
        )
    # A family of its own first (DeepSeek-V2 is also a MoE family), then the groups of families.
    own = {"gpt2": _gpt2, "phi3": _phi3, "gemma3": _gemma3_wrapper, "deepseek_v2": _deepseek_v2}
    if model_type in own:
        return own[model_type](cfg, source)
    group = (
        _llama_like if model_type in LLAMA_LIKE else _moe if model_type in MOE_FAMILIES else _dense
    )
    return group(cfg, model_type, source)


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
    vision_h = int(vision.get("hidden_size") or SIGLIP["hidden_size"])
    projector = vision_h * spec.hidden + vision_h  # projection weight and its soft-embedding norm
    return replace(spec, model_type="gemma3", vision_params=siglip_params(vision) + projector,
                   outer_quantized=siglip_linear_weights(vision))  # fmt: skip


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
