"""Load the model and tokenizer from a local folder, and make it trainable as the spec says.

Full fine-tunes keep fp32 master weights (bf16/fp16 autocast on CUDA); LoRA keeps a frozen base in
the compute dtype with fp32 adapters; QLoRA quantizes the linear layers to 4-bit NF4 with double
quantization and keeps the rest of the frozen base (embeddings, lm_head, norms) in the compute
dtype too (`train.lora` says why none of it needs fp32). Everything is read from the local folder:
no network, and the folder's own Python code runs only when the preset says
``model.trust_remote_code = true``. Results are written with safetensors only (never pickle).

Under FSDP2 (``load_model(..., sharded=True)``) no rank but rank 0 ever holds the whole model:
every rank builds it on the meta device (no memory), rank 0 alone also loads it on the CPU exactly
as DDP does (``from_pretrained``, then the LoRA adapters drawn from the seeded generator), and
after ``fully_shard`` `materialize` scatters each tensor's rows from rank 0 into each rank's new
shard, rank 0 freeing each source tensor once it is sent. So the host holds one full copy (rank
0's) at the start of the load and shrinks from there, each device holds its shards, and the
weights and adapters are bit for bit those every DDP rank loads. Non-persistent buffers (rotary
``inv_freq``) are sent too, never recomputed or left on meta; a tied lm_head is one parameter on
both sides and is sent once. Chosen over ``set_model_state_dict(broadcast_from_rank0=True)``,
which broadcasts every full tensor to every rank and loads only state-dict keys (not the
non-persistent buffers), and over ``model.to_empty``, which allocates every shard before the
first is filled (rank 0 would hold its shards beside the whole source copy).
"""

from __future__ import annotations

import gc
import json
import logging
import math
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from homelab_dp.errors import HomelabError
from homelab_dp.nf4_quantization import folder_model_type, nf4_config, quantize_experts
from homelab_dp.peft_targets import exact_targets
from homelab_dp.planning.attention_rule import has_sinks
from homelab_dp.planning.model_layers import nf4_skip_modules
from homelab_dp.presets.preset import Preset
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.model.attention import attention_implementation, local_capability
from homelab_dp.train.model.lora import (
    add_lora,
    disable_cpu_bf16_repack,
    is_outside_text,
    nf4_report,
    prepare_frozen_base,
    seed_adapters,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# "fp64" is accepted on the CPU only, for the exactness tests (see worker docstring).
_DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}


@dataclass
class LoadedModel:
    """A model ready to be wrapped by a strategy."""

    model: nn.Module
    """The Hugging Face model, or a peft ``PeftModel`` around it for lora/qlora."""
    is_peft: bool
    params: int
    """All parameters (4-bit weights counted as their logical size)."""
    trainable_params: int
    decoder_layers: list[nn.Module]
    """The transformer blocks: the unit FSDP2 shards and activation checkpointing recomputes."""
    on_meta: bool = False
    """Built on the meta device (a sharded load): `materialize` must run after ``fully_shard``."""
    source: nn.Module | None = None
    """Sharded load, rank 0 only: the same model with its real weights on the CPU, loaded as DDP
    loads it; `materialize` sends it into the shards and drops it."""
    materializer: Any = None
    """Sharded load: what fills the shards after ``fully_shard`` (``fn(loaded, device)``);
    None: `materialize` from ``source``. QLoRA streams from the folder
    (`train.model.quantized_load.stream_weights`)."""


def compute_dtype(resolved: Resolved) -> torch.dtype:
    """The dtype the matmuls run in: fp32 (or fp64) on CPU, bf16/fp16 on CUDA."""
    if resolved.device == "cpu":
        return torch.float64 if resolved.dtype == "fp64" else torch.float32
    return _DTYPES[resolved.dtype]


def master_dtype(resolved: Resolved) -> torch.dtype:
    """The dtype of the weights the optimizer updates (fp32 master weights except in fp64 mode)."""
    return torch.float64 if resolved.dtype == "fp64" else torch.float32


def card_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of the CUDA card ``device``; None for the CPU."""
    if device.type != "cuda":
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return int(major), int(minor)


def load_tokenizer(preset: Preset) -> Any:
    """The fast tokenizer of the model folder."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        preset.model.path, trust_remote_code=preset.model.trust_remote_code
    )


def load_model(
    preset: Preset,
    resolved: Resolved,
    device: torch.device,
    *,
    sharded: bool = False,
    compute: torch.dtype | None = None,
) -> LoadedModel:
    """Load the model for ``resolved.method`` on ``device``; LoRA adapters are seeded by train.seed.

    ``sharded`` (FSDP2, an initialised process group): build it on the meta device, rank 0 also
    loading the real weights on the CPU (see the module docstring). Not for QLoRA: under FSDP2
    it is built by `train.model.quantized_load.build_on_meta` (streamed, quantized as it is read).
    ``compute`` (tests and benchmarks only, not with ``sharded``): the LoRA/QLoRA base's dtype
    instead of `compute_dtype` (bf16 on the CPU, to see what a CUDA run holds).
    """
    from transformers import AutoModelForCausalLM

    method = resolved.method
    if sharded and method == "qlora":
        raise ValueError("QLoRA under FSDP2 loads through train.quantized_load.build_on_meta")
    if sharded:
        return _load_on_meta(preset, resolved)
    compute = compute or compute_dtype(resolved)
    model_type = model_type_of(preset)
    kwargs: dict[str, Any] = {
        "trust_remote_code": preset.model.trust_remote_code,
        # FlashAttention-2's varlen kernel on an sm80+ card with flash-attn 2.x installed, else
        # homelab_packed: each sample of a packed block alone, SDPA for other masks.
        "attn_implementation": attention_implementation(
            device.type, resolved.dtype, capability=card_capability(device), model_type=model_type
        ),
        **experts_implementation(resolved),
        **text_only_load(preset),
    }
    if method == "qlora":
        kwargs["quantization_config"] = nf4_config(
            compute, skip_modules=nf4_skip_modules(folder_model_type(preset.model.path))
        )
        kwargs["dtype"] = compute  # what is not 4-bit (embeddings, lm_head, norms)
        kwargs["device_map"] = {"": device}
    elif method == "lora":
        # The frozen base only needs the compute dtype; the adapters are made fp32 by peft.
        kwargs["dtype"] = compute
    else:
        kwargs["dtype"] = master_dtype(resolved)
    if method != "qlora" and prequantized(preset) == "mxfp4":
        # gpt-oss ships MXFP4 experts: trained (full or LoRA) on their values dequantized to
        # the dtype above; MXFP4 kernels have no backward.
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    if (
        kwargs["attn_implementation"] != "flash_attention_2"
        and not has_sinks(model_type)  # homelab_packed adds gpt-oss's sinks
        and not supports_sdpa(preset)
    ):
        kwargs["attn_implementation"] = "eager"  # a family with no SDPA path
    start = start_adapter(preset)
    if start is not None and method == "qlora":
        raise HomelabError(
            f"model.adapter {start}: QLoRA quantizes the base as it loads, and an adapter "
            "merged into 4-bit weights would be rounded away",
            hint="start from the run's merged model (`homelab-dp export RUN --format merged`, "
            "then model.path = that folder), or train with train.method = lora",
        )
    model = AutoModelForCausalLM.from_pretrained(preset.model.path, **kwargs)
    if start is not None:  # the earlier run's model: what training starts from and the reference
        model = merge_start_adapter(model, start)
    if method == "qlora":  # fused 3-D experts: NF4 too (bitsandbytes quantized the linears)
        quantize_experts(model, compute)
    frozen = freeze_non_text(model)
    if frozen:
        log.info("multimodal model: %d parameters outside the language model frozen", frozen)
    if method != "qlora":
        model.to(device)
    model.config.use_cache = False  # no KV cache while training
    # from_pretrained returns the model in eval mode, where dropout is off and transformers
    # silently skips activation checkpointing (it recomputes only while training).
    model.train()
    ac = resolved.activation_checkpointing
    if method in ("lora", "qlora"):  # frozen, in the dtype it was loaded in (train.lora)
        # fp16 (no bf16 on the card): embeddings and norms in fp32, the residual stream too.
        model = prepare_frozen_base(
            model, gradient_checkpointing=ac, fp32_residual=compute == torch.float16
        )
    elif ac:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = count_params(model)
    if method in ("lora", "qlora"):
        model = add_lora(model, preset.lora)
    if method == "qlora":  # the adapters FSDP2's streamed load makes too (`adapter_init`)
        seed_adapters(model, preset.train.seed)
    if method == "qlora" and device.type == "cpu":
        disable_cpu_bf16_repack(model)
    if method == "qlora":  # what bitsandbytes quantized, what it kept 16-bit (and why: lora)
        log.info(nf4_report(model))
    layers = decoder_layers(model)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return LoadedModel(model, method != "full", params, trainable, layers)


def start_adapter(preset: Preset) -> Path | None:
    """The LoRA adapter of an earlier run to merge into model.path as it loads (model.adapter,
    set when model.path names a LoRA run, `homelab_dp.runs.model_ref.with_run_model`), or None."""
    adapter = preset.model.adapter
    return Path(adapter) if adapter else None


def merge_start_adapter(model: nn.Module, adapter: Path) -> nn.Module:
    """``model`` with the adapter folder's LoRA weights merged in (safetensors only, read by
    peft), in the dtype the model was loaded in: a plain model again, ready for new adapters."""
    from peft import PeftModel

    if not (adapter / "adapter_model.safetensors").is_file():
        raise HomelabError(
            f"model.adapter {adapter}: no adapter_model.safetensors",
            hint="point model.path at the LoRA run itself (its id) or at a merged model",
        )
    with exact_targets(adapter):
        merged = PeftModel.from_pretrained(model, str(adapter), is_trainable=False)
    return merged.merge_and_unload()


LOAD_WAIT_S = 3600
"""How long the other ranks wait for rank 0 to load the model in a sharded load: far beyond a
collective's timeout, as reading a large model from a slow disk takes minutes. A rank 0 that
fails instead ends the run at once (torchrun stops the other ranks)."""
_LOADED_KEY = "homelab_dp/sharded-load/rank0-loaded"


def _load_on_meta(preset: Preset, resolved: Resolved) -> LoadedModel:
    """The sharded load's first half: the model on meta everywhere, on the CPU on rank 0."""
    from datetime import timedelta

    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    source = None
    if dist.get_rank() == 0:  # the model every DDP rank would load, adapters and all
        source = load_model(preset, resolved, torch.device("cpu")).model
    config = text_only_load(preset).get("config") or AutoConfig.from_pretrained(
        preset.model.path, trust_remote_code=preset.model.trust_remote_code
    )
    dtype = compute_dtype(resolved) if resolved.method == "lora" else master_dtype(resolved)
    with torch.device("meta"):  # parameters and buffers without storage, no generator draws
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, trust_remote_code=preset.model.trust_remote_code,
            attn_implementation=attention_implementation(resolved.device, resolved.dtype,
                                                         capability=local_capability(),
                                                         model_type=config.model_type)
            if supports_sdpa(preset) or has_sinks(config.model_type) else "eager",
            **experts_implementation(resolved),
        )  # fmt: skip
        model.config.use_cache = False
        model.train()
        if resolved.method == "lora":
            model = prepare_frozen_base(
                model, gradient_checkpointing=resolved.activation_checkpointing
            )
        elif resolved.activation_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        params = count_params(model)
        if resolved.method == "lora":
            model = add_lora(model, preset.lora)
    # The other ranks wait on the rendezvous store, not in the first collective (its timeout).
    store = dist.distributed_c10d._get_default_store()
    if source is not None:
        store.set(_LOADED_KEY, "1")
    else:
        store.wait([_LOADED_KEY], timedelta(seconds=LOAD_WAIT_S))
    _match_source(model, source)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return LoadedModel(model, resolved.method != "full", params, trainable,
                       decoder_layers(model), on_meta=True, source=source)  # fmt: skip


def _tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter (a tied one once) and every buffer, persistent or not, by name."""
    yield from model.named_parameters()
    yield from model.named_buffers()


def _match_source(model: nn.Module, source: nn.Module | None) -> None:
    """Check the meta model against rank 0's loaded one (a collective) and take its dtypes.

    Names and shapes must agree on every rank before any tensor is sent; a dtype that differs
    (a module ``from_pretrained`` keeps in fp32) is taken from the loaded model.
    """
    import torch.distributed as dist

    layout: list[Any] = [None]
    if source is not None:
        layout = [[(n, tuple(t.shape), t.dtype) for n, t in _tensors(source)]]
    dist.broadcast_object_list(layout, src=0)
    mine = {n: t for n, t in _tensors(model)}
    loaded = {n: (shape, dtype) for n, shape, dtype in layout[0]}
    differ = sorted(set(mine) ^ set(loaded)) or [
        n for n, t in mine.items() if tuple(t.shape) != loaded[n][0]
    ]
    if differ:
        raise HomelabError(
            f"sharded load: the model built from config.json differs from the one loaded from "
            f"the folder ({len(differ)} tensors, first {differ[0]!r})",
            hint="set train.distribution = 'ddp' (loads the model whole on every rank)",
        )
    for n, t in mine.items():
        if t.dtype != loaded[n][1]:
            t.data = t.data.to(loaded[n][1])


def materialize(loaded: LoadedModel, device: torch.device, *, host_shards: bool = False) -> None:
    """Give the sharded meta model its weights, tensor by tensor, from rank 0 (a collective).

    After ``fully_shard``. Each parameter gets this rank's rows on ``device`` (FSDP2 shards dim 0
    in ``torch.chunk`` pieces), scattered from rank 0, and takes them in place of its meta
    tensor (``swap_tensors``: the same Parameter object, so ties and FSDP2's references hold;
    FSDP2 pads it at its lazy init). Buffers are broadcast whole. Nothing full-sized is allocated
    on the other ranks, and rank 0 drops each source tensor once it is sent, so its memory only
    shrinks from the one copy it loaded (plus its shard of the tensor in flight).
    """
    import torch.distributed as dist

    model = loaded.model
    source: dict[str, torch.Tensor] = {}
    if loaded.source is not None:
        source = dict(_tensors(loaded.source))
        loaded.source = None
        gc.collect()  # the module tree goes; its tensors live on in ``source`` until sent
    rank, world = dist.get_rank(), dist.get_world_size()
    with torch.no_grad():
        for name, param in list(model.named_parameters()):  # a tied weight comes once
            full = source.pop(name, None) if rank == 0 else None
            real = receive(param, full, device, rank, world, host_shard=host_shards)
            del full
            torch.utils.swap_tensors(param, nn.Parameter(real, requires_grad=param.requires_grad))
        made: dict[int, torch.Tensor] = {}
        for module_name, module in list(model.named_modules()):
            for key, buf in list(module._buffers.items()):
                if buf is None or not buf.is_meta:
                    continue
                if id(buf) not in made:  # a buffer shared by two modules is sent once
                    name = f"{module_name}.{key}" if module_name else key
                    full = source.pop(name, None) if rank == 0 else None
                    made[id(buf)] = receive(buf, full, device, rank, world)
                    del full
                module._buffers[key] = made[id(buf)]
    check_materialized(model, source)


def check_materialized(model: nn.Module, source: dict[str, torch.Tensor]) -> None:
    """Raise `HomelabError` if a tensor of ``model`` is still on meta or ``source`` (what rank
    0 loaded) has tensors that were never sent."""
    left = [n for n, t in _tensors(model) if t.is_meta] + [
        f"{type(m).__name__}.{k}"
        for m in model.modules()
        for k, v in vars(m).items()
        if isinstance(v, torch.Tensor) and v.is_meta
    ]
    if left or source:
        raise HomelabError(
            f"sharded load: {len(left)} tensors left on meta (first {(left or [None])[0]!r}), "
            f"{len(source)} loaded tensors not sent (first {next(iter(source), None)!r})",
            hint=_DDP_HINT,
        )


_DDP_HINT = "set train.distribution = 'ddp' (loads the model whole on every rank)"


def receive(
    t: torch.Tensor, full: torch.Tensor | None, device: torch.device, rank: int, world: int,
    *, host_shard: bool = False,
) -> torch.Tensor:  # fmt: skip
    """A real tensor for the meta ``t``: this rank's shard of a DTensor, or a whole buffer.

    ``full`` is rank 0's loaded tensor (None elsewhere). Every rank allocates only what it keeps
    (and, for an uneven last shard, one padded piece); rank 0 also makes ``full``'s copy on
    ``device`` when that is not the CPU, and pads the short pieces.
    """
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):  # buffers (and any parameter FSDP2 does not manage)
        out = torch.empty(t.shape, dtype=t.dtype, device=device)
        if full is not None:
            out.copy_(full)
        dist.broadcast(out, src=0)
        return out
    if tuple(t.placements) != (Shard(0),) or t.device_mesh.ndim != 1:
        raise HomelabError(f"sharded load: unexpected placement {t.placements}", hint=_DDP_HINT)
    n, rest = t.shape[0], tuple(t.shape[1:])
    rows = -(-n // world)  # torch.chunk's piece: rank r holds rows [r·rows, (r+1)·rows)
    mine = max(0, min(rows, n - rank * rows))
    if tuple(t.to_local().shape) != (mine, *rest):
        raise HomelabError(
            f"sharded load: rank {rank} holds {tuple(t.to_local().shape)}, expected {mine} rows",
            hint=_DDP_HINT,
        )
    local = torch.empty((mine, *rest), dtype=t.dtype, device=device)
    out = local if mine == rows else torch.empty((rows, *rest), dtype=t.dtype, device=device)
    pieces = None
    if full is not None:
        whole = full.to(device=device, dtype=t.dtype)  # no copy on the CPU
        pieces = []
        for r in range(world):
            piece = whole[r * rows : (r + 1) * rows]
            if piece.shape[0] < rows:  # the last pieces are short or empty: pad them
                padded = whole.new_zeros((rows, *rest))
                padded[: piece.shape[0]] = piece
                piece = padded
            pieces.append(piece.contiguous())
    dist.scatter(out, pieces, src=0)
    if out is not local:
        local.copy_(out[:mine])
    if host_shard and local.device.type == "cuda":
        # train.offload = "params": FSDP2's CPU offload wants every shard in (pinned) host
        # memory before its first forward; moved one at a time, so no card holds them all.
        local = local.to("cpu").pin_memory()
    return DTensor.from_local(
        local, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
    )


def experts_implementation(resolved: Resolved) -> dict[str, str]:
    """transformers' MoE experts kernel for this run: its default (``grouped_mm``) except in
    fp64 (the CPU exactness runs), which ``torch._grouped_mm`` does not take: the eager loop
    over the routed experts then (the same math, expert by expert)."""
    return {"experts_implementation": "eager"} if resolved.dtype == "fp64" else {}


def model_type_of(preset: Preset) -> str:
    """The ``model_type`` of the preset's model folder (its config)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        preset.model.path, trust_remote_code=preset.model.trust_remote_code
    )
    return str(config.model_type)


def supports_sdpa(preset: Preset) -> bool:
    """Whether the folder's CausalLM class has an SDPA attention path (``_supports_sdpa``)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(
        preset.model.path, trust_remote_code=preset.model.trust_remote_code
    )
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return cls is None or bool(getattr(cls, "_supports_sdpa", True))


def prequantized(preset: Preset) -> str | None:
    """The ``quant_method`` of the folder's ``config.json`` (``"mxfp4"`` for gpt-oss), or None."""
    path = Path(preset.model.path) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None  # from_pretrained reports a missing or broken config itself
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return str(quant.get("quant_method")) if isinstance(quant, dict) else None


TEXT_KEYS = {
    r"^language_model\.model\.": "model.",  # the layout Gemma 3 and Mistral 3 were saved in
    r"^language_model\.lm_head\.": "lm_head.",
    r"^model\.language_model\.": "model.",  # transformers 5's own layout
}
"""How a multimodal checkpoint's language-model tensors are named in the text-only model."""


def text_only_load(preset: Preset) -> dict[str, Any]:
    """``from_pretrained`` arguments that load a multimodal wrapper's language model alone
    (``model.text_only``): its ``text_config`` and the checkpoint's names mapped to it, the
    vision tower left unread. {} when the preset keeps the whole model or has no text_config."""
    if not preset.model.text_only:
        return {}
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(
        preset.model.path, trust_remote_code=preset.model.trust_remote_code
    )
    text = getattr(config, "text_config", None)
    if text is None:
        return {}
    return {"config": text, "key_mapping": dict(TEXT_KEYS)}


def freeze_non_text(model: nn.Module) -> int:
    """Freeze the parts of a multimodal wrapper outside its language model (vision tower,
    projector: `train.model.lora.is_outside_text`), which text data never trains; how many parameters.
    0 for a text-only model."""
    n = 0
    for name, param in model.named_parameters():
        if is_outside_text(name) and param.requires_grad:
            param.requires_grad_(False)
            n += param.numel()
    return n


def count_params(model: nn.Module) -> int:
    """Logical parameter count; a packed 4-bit weight holds two values per byte."""
    total = 0
    for p in model.parameters():
        n = p.numel()
        if hasattr(p, "nf4_logical_shape"):  # a fused expert stack in NF4 (quantized_experts)
            n = math.prod(p.nf4_logical_shape)
        elif p.dtype == torch.uint8 and hasattr(p, "quant_state"):
            n *= 2
        total += n
    return total


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks, found by the model's ``_no_split_modules`` class names."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if layers:
        return layers
    # Fallback: the longest ModuleList (the stack of blocks in every causal LM we know).
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def save_full_model(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor] | None,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
) -> None:
    """Write a Hugging Face model folder (config + safetensors) and the tokenizer.

    ``state_dict`` is the gathered full state dict (FSDP2); None saves the module's own weights.
    """
    kwargs = {} if state_dict is None else {"state_dict": state_dict}
    model.save_pretrained(str(out_dir), **kwargs)
    tokenizer.save_pretrained(str(out_dir))


def save_adapter(
    model: nn.Module,
    state_dict: dict[str, torch.Tensor] | None,
    tokenizer: PreTrainedTokenizerBase,
    out_dir: Path,
) -> None:
    """Write a peft adapter folder (adapter_config.json + adapter_model.safetensors)."""
    kwargs = {} if state_dict is None else {"state_dict": state_dict}
    model.save_pretrained(str(out_dir), safe_serialization=True, **kwargs)
    tokenizer.save_pretrained(str(out_dir))


def merge_adapter(
    preset: Preset, adapter_dir: Path, tokenizer: PreTrainedTokenizerBase, out_dir: Path
) -> None:
    """Merge a saved adapter into a fresh, unquantized copy of the base model and save it.

    QLoRA adapters are merged into the 16/32-bit base, not the 4-bit one: merging into quantized
    weights would round the update away.
    """
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(
        preset.model.path, dtype="auto", trust_remote_code=preset.model.trust_remote_code
    )
    start = start_adapter(preset)
    if start is not None:  # the model this run started from: the base with the earlier adapter
        base = merge_start_adapter(base, start)
    with exact_targets(adapter_dir):
        merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    merged.save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    tmp.rename(out_dir)
