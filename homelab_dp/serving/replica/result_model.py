"""Load a `ModelRef` for generation: one plain causal LM in eval mode, and its tokenizer.

- A full model folder loads with ``AutoModelForCausalLM.from_pretrained`` (safetensors only).
- A PEFT adapter loads onto its base and is merged (``merge_and_unload``) in the compute dtype,
  so generation runs one plain model with no adapter arithmetic per token.
- A QLoRA result (``ModelRef.quantized == "nf4"``) loads on the base it was trained against:
  quantized to NF4 as training quantized it (`nf4_config`), the adapter kept apart
  (merging into 4-bit weights would round the update away), wherever bitsandbytes' 4-bit
  kernels run on the device (`nf4_works`: CUDA, and the CPU with a bitsandbytes that has CPU
  kernels). Elsewhere it falls back to the 16-bit base with the adapter merged; ``Loaded.base``
  says which base was used.
- The weights load in the dtype (``from_pretrained(dtype=...)``) and are moved with
  ``.to(device)`` only: a ``.to(dtype)`` would also cast the rotary ``inv_freq`` buffers and the
  modules a model keeps in fp32 (``_keep_in_fp32_modules``), and rotary angles in 16 bits drift
  with the position (transformers PR 29285).
- The dtype: fp32 on the CPU (whatever the run trained in: CPU matmuls in bf16/fp16 are slow and
  fp16 lacks kernels there); on CUDA the run's preset dtype where it names one, else bf16 when the
  card supports it (compute capability 8.0+), else fp16. A bf16 preset on a card without bf16
  falls back to fp16.
- The model folder's own code runs only when the run's preset allowed it
  (``ModelRef.trust_remote_code``; never for a bare folder).

The torch half of `export`: one standalone model folder from a run's result, on the CPU.

- An adapter is applied to a fresh, unquantized copy of its base (QLoRA included: merging into
  4-bit weights would round the update away) loaded in the run's compute dtype, and merged
  (``merge_and_unload``). Loading in the compute dtype, not fp32, keeps the host memory at the
  size of the exported weights; peft computes each update ``B @ A`` in fp32 on the CPU and
  rounds once when it adds it.
- A full fine-tune's weights (fp32 master weights) load in the compute dtype.
- Whatever ``from_pretrained`` keeps in fp32 in that dtype (a model's
  ``_keep_in_fp32_modules``) stays fp32 in the folder written: nothing is cast after the load
  but a parameter that left the load's dtype (`restore_dtypes`), never a buffer (rotary
  ``inv_freq`` stays fp32).
- ``auto`` (a bare folder, not a run) keeps the dtype the weights are stored in.

The folder gets config.json (its ``dtype`` is the dtype written), the weights as safetensors
(transformers writes nothing else), generation_config.json where the model has one, and the
tokenizer with its chat template (``chat_template.jinja``).

Never on a GPU: this runs in the CLI's process or the TUI's export child, front ends that must
not hold a CUDA context on any card.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from homelab_dp.errors import HomelabError
from homelab_dp.nf4_quantization import folder_model_type, nf4_config, nf4_works, quantize_experts
from homelab_dp.peft_targets import exact_targets
from homelab_dp.planning.attention_rule import inference_attention
from homelab_dp.planning.model_layers import nf4_skip_modules
from homelab_dp.runs.model_ref import ModelRef, refuse_pickle_only

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Loaded:
    """A model ready to generate with."""

    model: torch.nn.Module
    """The causal LM (eval mode, on ``device``, adapters merged)."""
    tokenizer: PreTrainedTokenizerBase
    """Its tokenizer (a pad token always set: eos where the folder has none)."""
    device: torch.device
    """Where the model lives."""
    dtype: torch.dtype
    """The dtype its weights and matmuls use."""
    context: int
    """The positions the model can attend over (config max_position_embeddings / n_positions)."""
    base: str = ""
    """The base weights it computes with: ``nf4`` (a QLoRA result on its quantized base), else
    the dtype's name (fp32, bf16, fp16)."""


def parse_device(device: str) -> torch.device:
    """``cpu`` or ``cuda:N`` as a torch device; a bad name or a missing card is a HomelabError."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise HomelabError(
            f"device {device!r}: not a device name", hint="use cpu or cuda:N (e.g. cuda:0)"
        ) from None
    if dev.type not in ("cpu", "cuda"):
        raise HomelabError(f"device {device!r}: only cpu and cuda are supported", hint="use cpu")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise HomelabError(
                f"device {device!r}: CUDA is not available to this torch",
                hint="use cpu, or install a CUDA build of torch that matches the driver",
            )
        index = dev.index or 0
        if index >= torch.cuda.device_count():
            raise HomelabError(
                f"device {device!r}: only {torch.cuda.device_count()} card(s) visible",
                hint="pick an index below that count",
            )
        dev = torch.device("cuda", index)
    return dev


def default_device() -> str:
    """The first visible GPU when torch sees one, else the CPU."""
    return "cuda:0" if torch.cuda.is_available() else "cpu"


def inference_dtype(device: torch.device, preset_dtype: str = "auto") -> torch.dtype:
    """The dtype to generate in on ``device`` (see the module docstring)."""
    if device.type != "cuda":
        return torch.float32
    bf16_ok = torch.cuda.get_device_capability(device)[0] >= 8 and torch.cuda.is_bf16_supported()
    wanted = _DTYPES.get(preset_dtype)
    if wanted is None:  # "auto" (or a bare folder)
        wanted = torch.bfloat16 if bf16_ok else torch.float16
    if wanted == torch.bfloat16 and not bf16_ok:
        wanted = torch.float16
    return wanted


def context_length(config: Any) -> int:
    """The positions a model attends over, from its config."""
    for key in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    raise HomelabError(
        "the model's config.json names no context length (max_position_embeddings)",
        hint="set max_position_embeddings in config.json",
    )


def load_tokenizer(ref: ModelRef) -> Any:
    """The tokenizer beside the result (or the base's), with a pad token (eos when missing)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        ref.tokenizer_path, trust_remote_code=ref.trust_remote_code
    )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def base_kind(ref: ModelRef, device: torch.device, dtype: torch.dtype) -> str:
    """The base ``ref`` loads on: ``nf4`` for a QLoRA result where bitsandbytes works on
    ``device``, else the dtype's name."""
    if ref.quantized == "nf4" and ref.is_adapter and nf4_works(device.type):
        return "nf4"
    return DTYPE_NAMES[dtype]


def load_error(what: str, exc: BaseException, hint: str) -> HomelabError:
    """``what`` failed because of ``exc`` (its first line, else its type), as the user's error."""
    reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return HomelabError(f"{what} ({reason})", hint=hint)


def load_for_inference(
    ref: ModelRef, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
) -> Loaded:
    """Load ``ref`` on ``device`` for generation, with its tokenizer: a QLoRA result on its NF4
    base with the adapter apart where bitsandbytes works, any other adapter merged.

    ``dtype``: the compute dtype instead of `inference_dtype`'s choice (tests: bf16 on the CPU).
    A folder that transformers cannot read becomes a HomelabError naming the folder.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load in a log or a chat says nothing useful
    dev = device if isinstance(device, torch.device) else parse_device(device)
    dtype = dtype or inference_dtype(dev, ref.dtype)
    base = base_kind(ref, dev, dtype)
    check_safetensors(ref)
    # In the dtype from the start: inv_freq and _keep_in_fp32_modules stay fp32.
    kwargs: dict[str, Any] = {"dtype": dtype, "trust_remote_code": ref.trust_remote_code}
    attention = inference_attention(_model_type(ref.config_path))
    if attention is not None:  # attention sinks kept (`planning.attention_rule`)
        kwargs["attn_implementation"] = attention
    if base == "nf4":
        kwargs["quantization_config"] = nf4_config(
            dtype, skip_modules=nf4_skip_modules(folder_model_type(ref.config_path))
        )
        kwargs["device_map"] = {"": dev}  # quantized as it is placed on the device
    try:
        tokenizer = load_tokenizer(ref)
        model = AutoModelForCausalLM.from_pretrained(
            ref.config_path, use_safetensors=True, **kwargs
        )
        if base == "nf4":  # bitsandbytes converts nn.Linear only: the fused experts as trained
            quantize_experts(model, dtype)
        if ref.is_adapter:
            from peft import PeftModel

            with exact_targets(ref.path):
                model = PeftModel.from_pretrained(model, ref.path)
            # Merging into 4-bit weights would round the update away: on NF4 the adapter
            # layers stay in the model (the transformers model peft injected them into, whose
            # forward generation calls as any other).
            model = model.get_base_model() if base == "nf4" else model.merge_and_unload()
    except Exception as exc:  # noqa: BLE001 - whatever the reason, this folder does not load
        raise load_error(f"{ref.path}: cannot load the model", exc,
                         "point at a complete model folder (config.json, safetensors weights, "
                         "tokenizer)") from None  # fmt: skip
    if base != "nf4":  # a quantized model is placed by device_map (and cannot be moved)
        model.to(dev)  # the device only: a dtype here would cast the fp32 buffers too
    model.eval()
    model.requires_grad_(False)
    return Loaded(model, tokenizer, dev, dtype, context_length(model.config), base)


def check_safetensors(ref: ModelRef) -> None:
    """Refuse a model or adapter folder whose weights are pickle only (never handed to
    ``torch.load``): a HomelabError naming the file (`runs.model_ref.refuse_pickle_only`)."""
    for folder in {ref.config_path, ref.path}:
        refuse_pickle_only(folder)


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def torch_dtype(name: str) -> torch.dtype | str:
    """The torch dtype for a run's dtype name (``auto``: as stored)."""
    return _DTYPES.get(name, "auto")


def load_merged(
    weights: Path, adapter: Path | None, dtype: str, trust_remote_code: bool = False
) -> Any:
    """The model in ``weights`` (a full folder, or the base of ``adapter``) in ``dtype`` on the
    CPU, with ``adapter`` merged into it."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    wanted = torch_dtype(dtype)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            weights, dtype=wanted, trust_remote_code=trust_remote_code, use_safetensors=True
        )
        loaded = {name: p.dtype for name, p in model.named_parameters()}
        if adapter is not None:
            from peft import PeftModel

            with exact_targets(adapter):
                model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    except Exception as exc:  # noqa: BLE001 - whatever the reason, these folders do not load
        raise load_error(f"{adapter or weights}: cannot load the model to export", exc,
                         "the run's result or its base model is damaged or missing; check the "
                         "folders") from None  # fmt: skip
    if isinstance(wanted, torch.dtype):
        restore_dtypes(model, loaded, wanted)
    model.eval()
    return model


def restore_dtypes(
    model: torch.nn.Module, loaded: dict[str, torch.dtype], wanted: torch.dtype
) -> int:
    """Give each floating parameter of the merged ``model`` the dtype the base loaded it in
    (``loaded``, by name; ``wanted`` for one the base did not have), so a module the model keeps
    in fp32 stays fp32; buffers are left alone. How many parameters were cast."""
    n = 0
    for module_name, module in model.named_modules():
        for name, param in list(module.named_parameters(recurse=False)):
            full = f"{module_name}.{name}" if module_name else name
            target = loaded.get(full, wanted)
            if param.is_floating_point() and param.dtype != target:
                param.data = param.data.to(target)
                n += 1
    return n


def save_model_folder(
    model: torch.nn.Module, tokenizer_path: Path, out: Path, trust_remote_code: bool = False
) -> None:
    """Write ``model`` (safetensors, config, generation config) and the tokenizer into ``out``."""
    from transformers import AutoTokenizer

    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=trust_remote_code)
    tokenizer.save_pretrained(out)


def merge_to(
    weights: Path,
    adapter: Path | None,
    tokenizer_path: Path,
    out: Path,
    dtype: str,
    trust_remote_code: bool = False,
) -> None:
    """`load_merged` then `save_model_folder`: one standalone HF model folder in ``out``."""
    model = load_merged(weights, adapter, dtype, trust_remote_code)
    save_model_folder(model, tokenizer_path, out, trust_remote_code)


def eos_texts(folder: Path) -> list[str]:
    """The text of every token that ends an answer in the model folder (the tokenizer's eos and
    the generation config's), for a Modelfile's stop parameters."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids: list[int] = []
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    try:
        extra = GenerationConfig.from_pretrained(folder).eos_token_id
    except OSError:  # no generation_config.json
        extra = None
    for i in [extra] if isinstance(extra, int) else list(extra or []):
        if int(i) not in ids:
            ids.append(int(i))
    return [tokenizer.decode([i], skip_special_tokens=False) for i in ids]


def _model_type(folder: Path) -> str | None:
    """The ``model_type`` of ``folder``'s config.json (None when it cannot be read)."""
    try:
        doc = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc.get("model_type") if isinstance(doc, dict) else None
