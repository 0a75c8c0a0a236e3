"""Adapters made and loaded on exactly the modules they name (peft 0.21 with transformers 5).

peft rewrites a LoRA config's ``target_modules`` for families in transformers' v4 → v5 weight
conversion table (``ernie4_5_moe``, ``qwen3_moe``, ``qwen3_next``, ``glm4_moe``, ``deepseek_v3``,
``mixtral`` and others), so that an adapter trained on transformers 4, whose routed experts were
separate ``nn.Linear`` layers, still finds them: every target called ``gate_proj``, ``up_proj``,
``down_proj`` (``w1``/``w2``/``w3``), or ending so, becomes the fused experts' 3-D parameters
(``target_parameters``). That holds for names a v4 adapter used for its experts, and also for the
dense MLP of a MoE model's first layers and its shared experts: an explicit list naming
``model.layers.0.mlp.down_proj`` lost the dense layer's and the shared experts' adapters and
adapted every routed expert instead, which "all-linear" never asks for (`train.lora`).

`exact_targets` skips that rewrite where the adapter names transformers 5 modules already: a
config whose targets are full dotted module names (the lists `train.model.lora.lora_targets` writes;
peft saves them as bare names), or, when loading an adapter folder, one whose every LoRA weight
sits on a module this model has (an adapter trained on transformers 4 has its experts' weights
on ``experts.N.w1`` and the like, which transformers 5 no longer builds: it is converted as peft
does). The worker, `eval`, `export` and the replicas make and load adapters inside it, so an
adapter is trained, evaluated and served on the same modules.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def names_modules_exactly(peft_config: Any) -> bool:
    """Whether a LoRA config's ``target_modules`` is a list of full dotted module names."""
    targets = getattr(peft_config, "target_modules", None)
    if isinstance(targets, str) or not targets:
        return False
    return all("." in str(t) for t in targets)


def adapter_modules(folder: str | Path) -> set[str] | None:
    """The modules a saved adapter's LoRA weights sit on (``model.layers.0.mlp.down_proj``),
    from its ``adapter_model.safetensors`` (None when there is none to read)."""
    from safetensors import safe_open

    path = Path(folder) / "adapter_model.safetensors"
    if not path.is_file():
        return None
    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
    out = set()
    for key in keys:
        head, sep, _ = key.partition(".lora_")
        if sep:
            out.add(head.removeprefix("base_model.model."))
    return out


@contextlib.contextmanager
def exact_targets(adapter: str | Path | None = None) -> Iterator[None]:
    """Within: peft does not rewrite a config that names transformers 5 modules (see the module
    docstring; ``adapter``: the folder being loaded, whose weights say which modules it was
    trained on); any other config is converted as peft does. Not thread-safe (patched for the
    duration of the block): the worker, eval and replicas load in one thread."""
    from peft.utils import transformers_weight_conversion as conversion

    original = conversion.convert_peft_config_for_transformers
    trained_on = adapter_modules(adapter) if adapter is not None else None

    @functools.wraps(original)
    def convert(peft_config: Any, model: Any, conversions: Any) -> None:
        if names_modules_exactly(peft_config):
            return
        if trained_on:
            present = {name for name, _ in model.named_modules()}
            if trained_on <= present:
                return
        original(peft_config, model=model, conversions=conversions)

    conversion.convert_peft_config_for_transformers = convert
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original
