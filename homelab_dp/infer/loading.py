"""Load a `ModelRef` for generation: one plain causal LM in eval mode, and its tokenizer.

- A full model folder loads with ``AutoModelForCausalLM.from_pretrained`` (safetensors only).
- A PEFT adapter loads onto its base and is merged (``merge_and_unload``) in the compute dtype,
  so generation runs one plain model with no adapter arithmetic per token.
- The dtype: fp32 on the CPU (whatever the run trained in: CPU matmuls in bf16/fp16 are slow and
  fp16 lacks kernels there); on CUDA the run's preset dtype where it names one, else bf16 when the
  card supports it (compute capability 8.0+), else fp16. A bf16 preset on a card without bf16
  falls back to fp16.
- The model folder's own code runs only when the run's preset allowed it
  (``ModelRef.trust_remote_code``; never for a bare folder).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from homelab_dp.errors import HomelabError
from homelab_dp.rundir.results import ModelRef

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Loaded:
    """A model ready to generate with."""

    model: Any
    """The causal LM (eval mode, on ``device``, adapters merged)."""
    tokenizer: Any
    """Its tokenizer (a pad token always set: eos where the folder has none)."""
    device: torch.device
    """Where the model lives."""
    dtype: torch.dtype
    """The dtype its weights and matmuls use."""
    context: int
    """The positions the model can attend over (config max_position_embeddings / n_positions)."""


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


def load_for_inference(ref: ModelRef, device: str | torch.device = "cpu") -> Loaded:
    """Load ``ref`` on ``device`` for generation (adapters merged), with its tokenizer.

    A folder that transformers cannot read becomes a HomelabError naming the folder.
    """
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a bar per load in a log or a chat says nothing useful
    dev = device if isinstance(device, torch.device) else parse_device(device)
    dtype = inference_dtype(dev, ref.dtype)
    kwargs = {"dtype": dtype, "trust_remote_code": ref.trust_remote_code}
    try:
        tokenizer = load_tokenizer(ref)
        model = AutoModelForCausalLM.from_pretrained(ref.config_path, **kwargs)
        if ref.is_adapter:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, ref.path).merge_and_unload()
    except Exception as exc:  # noqa: BLE001 - whatever the reason, this folder does not load
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise HomelabError(
            f"{ref.path}: cannot load the model ({reason})",
            hint="point at a complete model folder (config.json, safetensors weights, tokenizer)",
        ) from None
    model.to(device=dev, dtype=dtype)
    model.eval()
    model.requires_grad_(False)
    return Loaded(model, tokenizer, dev, dtype, context_length(model.config))
