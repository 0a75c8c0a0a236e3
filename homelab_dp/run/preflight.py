"""Checks made in the parent process before anything is spawned: loggers, model folder, data,
plan, and for a CUDA plan that the installed torch sees the planned cards.

Every problem found here is a `HomelabError` (exit 2, nothing started, nothing written).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from homelab_dp.core.hardware import HardwareReport, PlanHardware
from homelab_dp.core.preset import Preset
from homelab_dp.errors import HardwareSpecError, ModelSpecError, PresetError
from homelab_dp.run import doctor

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
REPORTER_INSTALL = {
    "tensorboard": ("tensorboard", "pip install tensorboard"),
    "wandb": ("wandb", 'pip install "homelab-dp[wandb]"'),
    "mlflow": ("mlflow", 'pip install "homelab-dp[mlflow]"'),
}
"""A ``log.report_to`` name → the module rank 0 imports and how to install it."""


def check_reporters(preset: Preset) -> None:
    """Every logger named in ``log.report_to`` is installed (found, not imported: wandb and
    mlflow take seconds to import)."""
    for name in preset.log.report_to:
        module, install = REPORTER_INSTALL[name]
        if importlib.util.find_spec(module) is None:
            raise PresetError(
                f'log.report_to: "{name}" is named, but the {module} package is not installed',
                hint=f'{install}, or take "{name}" out of log.report_to',
            )


def check_model_folder(preset: Preset) -> None:
    """The folder has safetensors weights and a tokenizer; remote code only when allowed."""
    folder = Path(preset.model.path)
    if not any(folder.glob("*.safetensors")):
        pickles = sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES)
        if pickles:
            raise ModelSpecError(
                f"{folder}: only pickle weights ({', '.join(pickles[:3])}); refused, never loaded",
                hint="pickle files can run code when loaded; convert the model to safetensors "
                "(save_pretrained(..., safe_serialization=True)) on a machine you trust",
            )
        raise ModelSpecError(
            f"{folder}: no weights (*.safetensors)",
            hint="model.path must be a full Hugging Face model folder, not just its config",
        )
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model")):
        raise ModelSpecError(
            f"{folder}: no tokenizer (tokenizer.json or tokenizer.model)",
            hint="copy the tokenizer files of the model into its folder",
        )
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("auto_map") and not preset.model.trust_remote_code:
        raise ModelSpecError(
            f"{folder / 'config.json'}: the model needs its own Python code (auto_map), "
            "and model.trust_remote_code is false",
            hint="read the folder's .py files first; then set model.trust_remote_code = true",
        )


def check_torch_sees_cards(hardware: PlanHardware, report: HardwareReport | None) -> None:
    """A CUDA plan needs a torch that can use the probed cards: a CUDA build whose CUDA starts
    and that lists the same cards as NVML. CPU plans never import torch here."""
    if hardware.kind != "cuda" or report is None or not report.gpus:
        return
    problem = doctor.torch_mismatch(report, doctor.torch_facts())
    if problem is None:
        return
    planned = ", ".join(str(i) for i in hardware.indices) or "?"
    message, hint = problem
    gpus = "GPUs" if len(hardware.indices) > 1 else "GPU"
    raise HardwareSpecError(
        f"the plan uses {gpus} {planned}: {message}",
        f"{hint}; `homelab-dp doctor` checks the whole machine",
    )


def load_tokenizer(preset: Preset) -> Any:
    """The model's tokenizer, offline."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        preset.model.path,
        trust_remote_code=preset.model.trust_remote_code,
        local_files_only=True,
    )


def check_data(
    preset: Preset, max_positions: int, world_size: int, micro_batch: int
) -> tuple[int, float]:
    """Load and validate the dataset as the worker will; returns the number of training blocks
    (after any held-out split, `homelab_dp.data.split`) and the largest share of a block's
    tokens that are targets (what the chunked loss keeps). The eval data (data.eval_path or
    data.eval_fraction) is checked the same way: an error names its file and line or row.
    The tokenized samples go into the token cache (`homelab_dp.data.token_cache`), where every
    rank of the run reads them instead of tokenizing again."""
    from homelab_dp.data.loading import source_of
    from homelab_dp.data.split import load_train_eval
    from homelab_dp.data.tokenizer_ref import TokenizerRef

    # Before the tokenizer loads: a typo in a path or id is named at once.
    source_of(preset.data)
    if preset.data.eval_path:
        source_of(preset.data, eval_data=True)
    # Loaded only if the token cache misses: a hit imports no transformers here (seconds).
    tokenizer = TokenizerRef(Path(preset.model.path), lambda: load_tokenizer(preset))
    data = load_train_eval(
        preset.data,
        tokenizer,
        seed=preset.train.seed,
        seq_len_limit=max_positions or None,
        min_blocks=world_size * micro_batch,
    )
    blocks = data.train
    seq_len = max(1, int(preset.data.seq_len))
    return len(blocks), max(b.num_targets for b in blocks) / seq_len
