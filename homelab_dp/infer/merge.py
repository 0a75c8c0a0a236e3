"""The torch half of `export`: one standalone model folder from a run's result, on the CPU.

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

from pathlib import Path
from typing import Any

import torch

from homelab_dp.errors import HomelabError

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

            model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    except Exception as exc:  # noqa: BLE001 - whatever the reason, these folders do not load
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise HomelabError(
            f"{adapter or weights}: cannot load the model to export ({reason})",
            hint="the run's result or its base model is damaged or missing; check the folders",
        ) from None
    if isinstance(wanted, torch.dtype):
        restore_dtypes(model, loaded, wanted)
    model.eval()
    return model


def restore_dtypes(model: Any, loaded: dict[str, torch.dtype], wanted: torch.dtype) -> int:
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
    model: Any, tokenizer_path: Path, out: Path, trust_remote_code: bool = False
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
