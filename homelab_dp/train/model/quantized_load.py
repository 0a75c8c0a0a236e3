"""QLoRA under FSDP2: a 4-bit model that no process ever holds whole, in 16-bit or in 4-bit.

Every rank builds the model without weights (`build_on_meta`): the architecture from
``config.json`` on the meta device (buffers such as rotary ``inv_freq`` computed for real, on
every rank alike), the linear layers replaced by bitsandbytes ``Linear4bit`` exactly as
``from_pretrained`` with a ``BitsAndBytesConfig`` replaces them (the same modules kept 16-bit),
each 4-bit weight already in its packed shape, stored in the compute dtype
(``bnb_4bit_quant_storage``) so that FSDP2 shards it like any other parameter, and the LoRA
adapters on top. ``fully_shard`` then shards the empty model, and `stream_weights` fills it:
rank 0 reads the model folder's safetensors one tensor at a time (memory-mapped), casts it to
the compute dtype, quantizes a linear weight to NF4 on its own device (the card on CUDA), and
scatters each rank its rows; the quantization state (absmax, the double-quantization
statistics), which is no parameter, is broadcast whole. So host RAM holds one 16-bit tensor at
a time, rank 0's card one tensor and its packed copy beside its shards, and every rank ends with
only its shards. The quantized values are bit for bit those ``from_pretrained`` makes (the same
bitsandbytes call on the same values), and the adapters are `train.model.lora.adapter_init`'s, as on
the whole-model path, so QLoRA under FSDP2 learns what QLoRA under DDP learns.

Mixture-of-Experts: the fused 3-D expert weights (``experts.gate_up_proj``/``down_proj``),
which ``Linear4bit`` cannot hold, are packed the same way by `nf4_quantization.quantize_experts` (NF4 per
expert, stored in the compute dtype, sharded by expert along dim 0) and their quantization state
broadcast whole; a checkpoint storing them per expert (the published Qwen-MoE and Mixtral ones:
``experts.N.gate_proj/up_proj/down_proj``, ``block_sparse_moe.experts.N.w1/w3/w2``) is stacked
as transformers' own conversion stacks it, one 3-D tensor at a time on rank 0.

A pre-quantized checkpoint (a folder saved in 4-bit) is not read here: it needs
``train.distribution = "ddp"``.
"""

from __future__ import annotations

import functools
import json
import logging
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from homelab_dp.errors import HomelabError
from homelab_dp.nf4_quantization import (
    FUSED_WEIGHTS,
    expert_state_shapes,
    is_fused_experts,
    nf4_config,
    pack_experts_on_meta,
    quantize_expert_tensor,
)
from homelab_dp.planning.model_layers import nf4_skip_modules
from homelab_dp.presets.preset import Preset
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.model.attention import attention_implementation
from homelab_dp.train.model.lora import (
    adapter_init,
    add_lora,
    disable_cpu_bf16_repack,
    is_adapter,
    nf4_report,
    prepare_frozen_base,
)
from homelab_dp.train.model.model_census import any_model_spec
from homelab_dp.train.model.trainable_model import (
    LoadedModel,
    check_materialized,
    decoder_layers,
    receive,
)

_DDP_HINT = "set train.distribution = 'ddp' (QLoRA then loads the whole 4-bit model on each rank)"


log = logging.getLogger(__name__)


def has_routed_experts(preset: Preset) -> bool:
    """Whether the preset's model has routed experts (its `ModelSpec` has an MoE block: the
    same reading of config.json the plan makes, family defaults included), whose fused expert
    stacks QLoRA quantizes as it streams them (`build_on_meta`)."""
    model = preset.model
    spec = any_model_spec(
        model.path, trust_remote_code=model.trust_remote_code, text_only=model.text_only
    )
    return spec.experts is not None


def build_on_meta(preset: Preset, resolved: Resolved, compute: torch.dtype) -> Any:
    """The QLoRA model without weights, ready for ``fully_shard`` (see the module docstring).

    Returns a `train.model.trainable_model.LoadedModel` whose ``materializer`` is `stream_weights`.
    """
    import bitsandbytes as bnb
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.quantizers.quantizer_bnb_4bit import Bnb4BitHfQuantizer

    if preset.model.text_only:  # the streamed reader knows no multimodal checkpoint names
        raise HomelabError(
            "model.text_only: not with QLoRA's streamed load (FSDP2, or any MoE model)",
            hint="set model.text_only = false (the vision tower then loads frozen), or use "
            "train.method = 'lora'",
        )
    remote = preset.model.trust_remote_code
    config = AutoConfig.from_pretrained(preset.model.path, trust_remote_code=remote)
    qconfig = nf4_config(
        compute, storage=compute, skip_modules=nf4_skip_modules(str(config.model_type))
    )
    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers computed
        model = AutoModelForCausalLM.from_config(
            config, dtype=compute, trust_remote_code=remote,
            attn_implementation=attention_implementation(
                resolved.device, resolved.dtype, model_type=config.model_type
            ),
        )  # fmt: skip
    # init_empty_weights re-creates every parameter it registers, which unties a tied lm_head:
    # tie it again (one parameter, sent once), as from_pretrained does.
    model.tie_weights()
    with torch.device("meta"):
        quantizer = Bnb4BitHfQuantizer(qconfig)
        keep = quantizer.get_modules_to_not_convert(
            model, qconfig.llm_int8_skip_modules, model._keep_in_fp32_modules
        )
        replace_with_bnb_linear(model, modules_to_not_convert=keep, quantization_config=qconfig)
    params = sum(p.numel() for p in model.parameters())  # before packing: logical sizes
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            _pack_on_meta(module, compute)
    # MoE: the fused 3-D expert weights, which Linear4bit cannot hold, packed per expert the same
    # way (nf4_quantization), stored in the compute dtype so FSDP2 shards them by expert.
    pack_experts_on_meta(model, compute, storage=compute)
    model.config.use_cache = False
    model.train()
    model = prepare_frozen_base(model, gradient_checkpointing=resolved.activation_checkpointing)
    model = add_lora(model, preset.lora)  # on meta too: no draws; `stream_weights` fills them
    if resolved.device == "cpu":
        disable_cpu_bf16_repack(model)
    log.info(nf4_report(model))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    stream = functools.partial(
        stream_weights, folder=Path(preset.model.path), seed=preset.train.seed, compute=compute
    )
    return LoadedModel(
        model, True, params, trainable, decoder_layers(model), on_meta=True, materializer=stream
    )


def _pack_on_meta(module: nn.Module, storage: torch.dtype) -> None:
    """Give a meta ``Linear4bit`` its weight in the packed shape bitsandbytes quantizes to
    (two 4-bit values a byte, viewed as ``storage``), so ``fully_shard`` shards that shape."""
    import bitsandbytes as bnb

    old = module.weight
    n = old.numel()
    packed = torch.empty(((n + 1) // (storage.itemsize * 2), 1), dtype=storage, device="meta")
    module.logical_shape = tuple(old.shape)  # the checkpoint tensor's (out, in)
    # Kept on the module: FSDP2 replaces the Params4bit by a plain (DTensor) parameter.
    module.quant_settings = {"blocksize": old.blocksize, "quant_type": old.quant_type,
                             "compress_statistics": old.compress_statistics}  # fmt: skip
    module.weight = bnb.nn.Params4bit(
        packed,
        requires_grad=False,
        quant_storage=storage,
        module=module,
        bnb_quantized=True,
        **module.quant_settings,
    )
    module.quant_storage = storage


class _Checkpoint:
    """The model folder's safetensors, read one tensor at a time (rank 0 only)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            self.files = {k: folder / v for k, v in weight_map.items()}
        else:
            from safetensors import safe_open

            single = folder / "model.safetensors"
            if not single.is_file():
                raise HomelabError(f"{folder}: no model.safetensors or index", hint=_DDP_HINT)
            with safe_open(str(single), framework="pt") as f:
                self.files = {k: single for k in f.keys()}  # noqa: SIM118 (not a dict)
        self._open: dict[Path, Any] = {}

    def key_for(self, name: str, prefix: str) -> str | None:
        """The checkpoint key of the model's tensor ``name`` (with or without the base model's
        prefix, as checkpoints of some families are saved)."""
        for base in (name, name.replace(".mlp.", ".block_sparse_moe.")):  # Mixtral's name
            for key in (base, f"{prefix}.{base}", base.removeprefix(f"{prefix}.")):
                if key in self.files:
                    return key
        return None

    def experts(self, name: str, prefix: str, count: int) -> torch.Tensor | None:
        """The fused 3-D expert weight ``name`` (``...experts.gate_up_proj`` or ``down_proj``)
        from a checkpoint that stores it fused, or stacked from one stored per expert as the
        published Qwen-MoE (``experts.N.gate_proj/up_proj/down_proj``) and Mixtral
        (``experts.N.w1/w3/w2``) checkpoints are: gate and up concatenated, gate first, as
        transformers' own conversion (``conversion_mapping``) makes it, or dequantized from the
        MXFP4 blocks and scales gpt-oss ships (transformers' own dequantization, which
        ``Mxfp4Config(dequantize=True)`` uses), then re-quantized to NF4. None if absent."""
        key = self.key_for(name, prefix)
        if key is not None:
            return self.get(key)
        blocks, scales = (self.key_for(f"{name}_{part}", prefix) for part in ("blocks", "scales"))
        if blocks is not None and scales is not None:  # gpt-oss's MXFP4: dequantized first
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors

            return convert_moe_packed_tensors(
                self.get(blocks), self.get(scales), dtype=torch.float32
            )
        owner, _, attr = name.rpartition(".")
        parts = {"gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
                 "up_proj": (("up_proj",), ("w3",)),
                 "down_proj": (("down_proj",), ("w2",))}.get(attr, ())  # fmt: skip
        for names in parts:
            keys = [[self.key_for(f"{owner}.{e}.{n}.weight", prefix) for n in names]
                    for e in range(count)]  # fmt: skip
            if all(k is not None for row in keys for k in row):
                return torch.stack([torch.cat([self.get(k) for k in row]) for row in keys])
        return None

    def get(self, key: str) -> torch.Tensor:
        from safetensors import safe_open

        path = self.files[key]
        if path not in self._open:
            self._open = {path: safe_open(str(path), framework="pt")}  # one file open at a time
        return self._open[path].get_tensor(key)


def _base_name(name: str) -> str:
    """A PEFT parameter name as the base model names it (prefix and ``base_layer`` dropped)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def stream_weights(
    loaded: Any, device: torch.device, *, folder: Path, seed: int, compute: torch.dtype,
    host_shards: bool = False,
) -> None:  # fmt: skip
    """Fill the sharded meta QLoRA model from ``folder`` (a collective; after ``fully_shard``).

    Rank 0 makes each parameter's full value (read and cast; a 4-bit weight quantized on
    ``device``; an adapter from `adapter_init`) and `train.model.trainable_model.receive` scatters it; each
    ``Linear4bit`` gets the quantization state rank 0 made, broadcast (it stays on ``device``:
    the matmul dequantizes there). ``host_shards`` (``train.offload = "params"``): each shard
    goes to pinned host memory as it arrives. Raises `HomelabError` for a tensor the folder
    does not have.
    """
    import bitsandbytes as bnb
    from transformers.pytorch_utils import Conv1D

    model = loaded.model
    rank, world = dist.get_rank(), dist.get_world_size()
    source = _Checkpoint(folder) if rank == 0 else None
    prefix = getattr(model.get_base_model(), "base_model_prefix", "model")
    with torch.no_grad():
        for name, param in list(model.named_parameters()):  # a tied weight comes once
            owner_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(owner_name)
            four_bit = isinstance(owner, bnb.nn.Linear4bit) and attr == "weight"
            fused = _fused_name(owner, attr)
            full, state = None, None
            if source is not None:
                if fused:
                    state = _quantize_experts(source, owner, name, fused, prefix, device, compute)
                    full = state.pop("nf4")
                elif is_adapter(name):
                    full = adapter_init(name, param.shape, seed).to(device)
                else:
                    key = source.key_for(_base_name(name), prefix)
                    if key is None:
                        raise HomelabError(
                            f"{folder}: no tensor for {_base_name(name)!r} in the checkpoint",
                            hint=_DDP_HINT,
                        )
                    value = source.get(key).to(
                        device=device, dtype=compute if four_bit else param.dtype
                    )
                    if four_bit:
                        if getattr(owner, "source_cls", None) is Conv1D:
                            value = value.T  # GPT-2's Conv1D stores (in, out)
                        full, state = _quantize(owner, value, device)
                    else:
                        full = value
                    del value
            real = receive(param, full, device, rank, world, host_shard=host_shards)
            del full
            torch.utils.swap_tensors(param, nn.Parameter(real, requires_grad=param.requires_grad))
            if four_bit:
                owner.quant_state = _broadcast_state(state, device)
            if fused:
                _broadcast_expert_state(owner, fused, state, device, compute)
            del state
    check_materialized(model, {})


def _fused_name(owner: nn.Module, attr: str) -> str:
    """The fused expert weight a ``<name>_nf4`` parameter holds (``""`` for any other)."""
    name = attr.removesuffix("_nf4")
    return (
        name if attr.endswith("_nf4") and name in FUSED_WEIGHTS and is_fused_experts(owner) else ""
    )


def _quantize_experts(
    source: _Checkpoint, owner: nn.Module, name: str, fused: str, prefix: str,
    device: torch.device, compute: torch.dtype,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Rank 0: read the fused expert weight ``fused`` and NF4-quantize it expert by expert on
    ``device`` (nf4_quantization), stored in the compute dtype."""
    base = _base_name(name).removesuffix("_nf4")
    logical = tuple(getattr(owner, "nf4_logical", {}).get(fused, ()))
    value = source.experts(base, prefix, logical[0])
    if value is None:
        raise HomelabError(
            f"{source.folder}: no tensor for {base!r} in the checkpoint", hint=_DDP_HINT
        )
    if tuple(value.shape) != logical:
        raise HomelabError(
            f"checkpoint tensor {base!r} of shape {tuple(value.shape)} for {logical} experts",
            hint=_DDP_HINT,
        )
    return quantize_expert_tensor(value.to(device=device, dtype=compute), compute, storage=compute)


def _broadcast_expert_state(
    owner: nn.Module, fused: str, state: dict[str, torch.Tensor] | None, device: torch.device,
    compute: torch.dtype,
) -> None:  # fmt: skip
    """Rank 0's quantization state of ``fused`` on every rank, whole (the shapes are known:
    no object broadcast), as the experts module's buffers on ``device``."""
    shapes = expert_state_shapes(owner.nf4_logical[fused], compute)
    for key, (shape, dtype) in shapes.items():
        if key == "nf4":
            continue
        t = state[key].to(device) if state is not None else torch.empty(shape, dtype=dtype,
                                                                         device=device)  # fmt: skip
        dist.broadcast(t, src=0)
        owner.register_buffer(f"{fused}_{key}", t, persistent=False)


def _quantize(module: nn.Module, value: torch.Tensor, device: torch.device) -> tuple[Any, Any]:
    """NF4-quantize ``value`` as ``from_pretrained`` does (a ``Params4bit`` moved to its
    device); the packed tensor and its quantization state."""
    import bitsandbytes as bnb

    if tuple(value.shape) != module.logical_shape:
        raise HomelabError(
            f"checkpoint tensor of shape {tuple(value.shape)} for a {module.logical_shape} layer",
            hint=_DDP_HINT,
        )
    q = bnb.nn.Params4bit(
        value, requires_grad=False, quant_storage=module.quant_storage, **module.quant_settings
    )._quantize(device)
    return q.data, q.quant_state


def _broadcast_state(state: Any, device: torch.device) -> Any:
    """Rank 0's ``QuantState`` on every rank (its tensors broadcast on ``device``)."""
    from bitsandbytes.functional import QuantState

    layout: list[Any] = [None]
    packed: dict[str, torch.Tensor] = {}
    if state is not None:
        packed = state.as_dict(packed=True)
        layout = [{k: (tuple(v.shape), v.dtype) for k, v in packed.items()}]
    dist.broadcast_object_list(layout, src=0, device=device if device.type == "cuda" else None)
    out = {}
    for key, (shape, dtype) in layout[0].items():
        t = packed[key].to(device) if key in packed else torch.empty(shape, dtype=dtype,
                                                                      device=device)  # fmt: skip
        dist.broadcast(t, src=0)
        out[key] = t
    return QuantState.from_dict(qs_dict=out, device=device)
