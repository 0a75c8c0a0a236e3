"""The parts of a decoder layer (issue 36): linears, the MoE block, token mixers, layer kinds and
groups of equal layers (pure dataclasses; `planning.model_spec.ModelSpec` holds them)."""

from __future__ import annotations

from dataclasses import dataclass


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

    @property
    def weights(self) -> int:
        """The weight matrix alone (what QLoRA quantizes; a bias stays 16-bit)."""
        return self.d_in * self.d_out


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
    def expert_weights(self) -> int:
        """One routed expert's weight matrices (what QLoRA quantizes; biases stay 16-bit)."""
        return sum(lin.weights for lin in self.linears)

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


PEFT_MAMBA_TYPES = frozenset({"falcon_h1", "mamba", "mamba2", "falcon_mamba", "nemotron_h"})
"""Model types on which peft (0.21) refuses LoRA on any module named in `PEFT_MAMBA_REFUSED`
(``_check_lora_target_modules_mamba``: the fused Mamba kernels read those weights directly)."""
PEFT_MAMBA_REFUSED = frozenset({"out_proj", "conv1d"})


def lora_can_adapt(model_type: str, linear_name: str) -> bool:
    """Whether peft lets LoRA adapt the linear ``linear_name`` of a ``model_type`` model."""
    return not (
        model_type in PEFT_MAMBA_TYPES and linear_name.rsplit(".", 1)[-1] in PEFT_MAMBA_REFUSED
    )


NF4_FUSED_OUT_PROJ_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "nemotron_h", "bamba", "granitemoehybrid",
    "zamba2",
})  # fmt: skip
"""Families whose Mamba mixer hands ``out_proj.weight`` itself to mamba-ssm's fused kernel
(``mamba_split_conv1d_scan_combined(..., outproj_weight=self.out_proj.weight)`` in transformers
5.25's modeling code) when that kernel is installed: a packed 4-bit weight there would be read as
if it were the 16-bit matrix, so QLoRA keeps it 16-bit (peft refuses LoRA on it too)."""
NF4_DEFAULT_SKIPS = ("lm_head", "embed_out", "output_projection")
"""The output layer, which QLoRA keeps 16-bit, by the names decoders give it (``embed_out``:
GPT-NeoX-Japanese, ``output_projection``: BioGPT). Named explicitly because any skip list given
to bitsandbytes replaces transformers' own detection (`get_keys_to_not_convert`)."""
NF4_ROUTER_SKIPS = (
    ".gate", ".router", ".router.proj", ".router.layer", ".router.classifier", "expert_gate",
    "router_gate",
)  # fmt: skip
"""Routers kept 16-bit wherever they are an ``nn.Linear`` (a pure suffix match on the full
module name, as transformers matches ``llm_int8_skip_modules``): ``mlp.gate`` / ``.router``
(AFMoE, Llama 4, PhiMoE), a router's own projection (Gemma 4's ``router.proj``, DBRX's
``router.layer``, LongCat's ``router.classifier``), the Qwen MoE families'
``shared_expert_gate``. The plan counts a router 16-bit (`Experts.router_params`,
`Experts.shared_gate_params`); most transformers 5 routers are no ``nn.Linear`` at all, and
a 4-bit router would change which experts a token takes. Not ``per_layer_input_gate`` or
``gate_proj``: those are ordinary projections, quantized."""
NF4_FUSED_OUT_PROJ = "out_proj"


def nf4_skip_modules(model_type: str) -> list[str]:
    """The module names QLoRA keeps 16-bit on a ``model_type`` model, the one rule both sides
    use: the worker passes it to bitsandbytes (``llm_int8_skip_modules``, in every QLoRA load,
    eval, chat and serving) and the plan counts by it (`nf4_keeps_16bit`). The output layer
    (`NF4_DEFAULT_SKIPS`), routers (`NF4_ROUTER_SKIPS`) and, on `NF4_FUSED_OUT_PROJ_TYPES`,
    Mamba's ``out_proj``. Every other ``nn.Linear``, inside the decoder layers or outside them
    (Gemma 4's ``per_layer_model_projection``, a vision tower's linears), is quantized. The
    convolutions, ``A_log``, ``dt_bias``, ``D``, norms and embeddings are no linears and stay
    16-bit anyway."""
    out = [*NF4_DEFAULT_SKIPS, *NF4_ROUTER_SKIPS]
    if model_type in NF4_FUSED_OUT_PROJ_TYPES:
        out.append(NF4_FUSED_OUT_PROJ)
    return out


def nf4_keeps_16bit(model_type: str, linear_name: str) -> bool:
    """Whether QLoRA leaves the linear ``linear_name`` of a ``model_type`` model 16-bit:
    transformers' suffix match of `nf4_skip_modules` (``module_name.endswith(pattern)``). The
    name may be relative to a decoder layer (``mlp.gate``) or the full module name."""
    name = f".{linear_name}"
    return any(name.endswith(key) for key in nf4_skip_modules(model_type))


def nf4_weights(model_type: str, linears: tuple[Linear, ...]) -> int:
    """The weights of ``linears`` that QLoRA quantizes on a ``model_type`` model (those
    `nf4_keeps_16bit` keeps and every bias stay 16-bit)."""
    return sum(lin.weights for lin in linears if not nf4_keeps_16bit(model_type, lin.name))


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

    def quantized_params(self, model_type: str) -> int:
        """What 4-bit QLoRA quantizes in one such layer of a ``model_type`` model: the weights
        of the linears but those it keeps 16-bit (`nf4_keeps_16bit`: Mamba's ``out_proj``),
        of shared and routed experts (not the router); biases stay 16-bit."""
        routed = self.experts.count * self.experts.expert_weights if self.experts else 0
        return nf4_weights(model_type, self.linears) + routed

    def nf4_kept(self, model_type: str) -> tuple[Linear, ...]:
        """The linears QLoRA keeps 16-bit in one such layer of a ``model_type`` model."""
        return tuple(lin for lin in self.linears if nf4_keeps_16bit(model_type, lin.name))

    @property
    def carries_state(self) -> bool:
        """A mixer carries a recurrent or convolution state from token to token."""
        return any(m.kind in STATE_KINDS for m in self.mixers)


@dataclass(frozen=True)
class LayerGroup:
    """``count`` decoder layers of one kind (equal layers grouped wherever they sit)."""

    kind: LayerKind
    count: int
