"""Presets: the TOML schema of a fine-tune as typed dataclasses.

A preset is data, never code: it is parsed with `tomllib`, every key is checked against the
dataclasses below, unknown keys and wrong types are rejected, and every problem is reported at
once, each naming its key (``train.micro_batch``).

The sections of a preset: one dataclass per TOML table, a docstring on every field.

`homelab_dp.presets.preset` validates TOML against these; `field_docs` reads the docstrings.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from homelab_dp import vocabulary
from homelab_dp.errors import PresetError
from homelab_dp.presets import grpo_section
from homelab_dp.presets.grpo_section import GrpoSection, grpo_checks

Dtype = Literal["auto", vocabulary.Dtype]
DataFormat = Literal[
    "auto", "text", "completion", "instruction", "chat", "sharegpt", "preference", "kto"
]
Reporter = Literal["tensorboard", "wandb", "mlflow"]
Method = Literal["auto", vocabulary.Method]
Distribution = Literal["auto", vocabulary.Distribution]
Optimizer = Literal["adamw", "adamw8bit", "sgd"]
Offload = Literal["auto", vocabulary.Offload]
AutoBool = Literal["auto"] | bool


@dataclass
class ModelSection:
    """The model to fine-tune."""

    path: str = ""
    """A local Hugging Face model folder (config.json, tokenizer, weights), or a Hugging Face
    model id (org/name) found in the local Hugging Face cache (HF_HOME / HF_HUB_CACHE) and
    downloaded when missing and online (`homelab-dp pull ID` downloads ahead of time). Relative
    paths are looked up from the current folder, then beside the preset file, then one folder
    above it; a path found nowhere that reads as org/name is taken as a model id."""
    revision: str = ""
    """With a model id: the branch, tag or commit to use ("" : main). Ignored for a folder."""
    dtype: Dtype = "auto"
    """Compute dtype: auto (bf16 on CUDA where supported, fp32 on CPU) | bf16 | fp16 | fp32."""
    trust_remote_code: bool = False
    """Allow the model folder's own Python code to run. Off unless you trust the folder."""
    text_only: bool = False
    """For a multimodal model whose language model is a decoder (Gemma 3, Mistral 3, Qwen2.5-VL
    style configs with a ``text_config``): load the language model alone, without the vision
    tower. Off: the whole model loads and the vision tower stays frozen."""
    adapter: str = ""
    """A LoRA adapter folder merged into model.path as the model loads, so new adapters (and a
    DPO reference with them disabled) start from that model. Set by homelab-dp when model.path
    names a run whose result is an adapter; "" for none."""


@dataclass
class DataSection:
    """The training data."""

    path: str = ""
    """A local data file (.jsonl, .json, .csv, .parquet, .txt), a folder of such files, or a
    Hugging Face dataset id (org/name) found in the local Hugging Face cache."""
    split: str = "train"
    """The split to train on, for a dataset id or a folder with split files (train, test...)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Map the format's fields to the data's column names, e.g. {instruction = "question",
    output = "answer"} ({} : the columns carry the format's own names)."""
    format: DataFormat = "auto"
    """text ({"text"}) | completion ({"prompt","completion"}, loss on the completion only) |
    instruction ({"instruction","input","output"}) | chat (OpenAI messages: {"messages":
    [{"role","content"}]}, loss on assistant turns only) | sharegpt ({"conversations":
    [{"from","value"}]}, read as chat) | preference ({"prompt","chosen","rejected"} strings, or
    {"chosen": [messages], "rejected": [messages]} sharing every turn but the last, for
    train.objective dpo/orpo) | kto ({"prompt","completion","label": true|false}, for
    train.objective kto) | auto (detected from the first record's keys)."""
    seq_len: int = 256
    """Tokens per training sequence."""
    pack: bool = True
    """Bin-pack whole samples into seq_len blocks (best fit, longest first). Positions restart
    at each sample and attention never crosses samples, so the loss and the update are exactly
    those of one padded sample per row, without the padding. Samples longer than seq_len are
    truncated (text is split into seq_len pieces). false pads each sample to seq_len instead."""
    eval_path: str = ""
    """Data to evaluate on while training: a file, folder or dataset id like data.path (of a
    folder or id, its validation split, else its test split), read with data.format and
    data.columns; "" for none. Not with eval_fraction."""
    eval_fraction: float = 0.0
    """Hold out this share (0 to 0.5) of the training samples, chosen by train.seed before
    packing, to evaluate on; they are never trained on. 0 for none. Not with eval_path."""
    sample_prompts: str | list[str] = field(default_factory=list)
    """Prompts the model answers while it trains (`train.sample_every`): a list of strings, or
    a file (.txt: one prompt per line; .jsonl: a "prompt" per line). [] : a few prompts from
    the eval split, else from the training data."""


@dataclass
class TrainSection:
    """How to train."""

    method: Method = "auto"
    """auto (the planner picks) | full | lora | qlora."""
    objective: vocabulary.Objective = "sft"
    """sft (supervised fine-tuning on the target tokens) | dpo (Direct Preference Optimization
    on chosen/rejected pairs) | orpo (SFT on the chosen answer plus an odds-ratio term; no
    reference model) | kto (completions labelled desirable or not) | grpo (reinforcement learning
    on completions the model generates for prompts, scored by the [grpo] rewards). dpo, orpo
    and kto need preference data (data.format preference or kto); grpo prompts."""
    beta: float = 0.1
    """DPO/KTO: the temperature of the implicit reward, beta × (log π − log π_ref); higher keeps
    the policy closer to the reference."""
    dpo_loss: Literal["sigmoid", "ipo"] = "sigmoid"
    """DPO's loss on the reward margin: sigmoid (the DPO paper's −log σ(β·margin)) | ipo
    ((margin − 1/(2β))², IPO, on length-averaged log-probabilities)."""
    orpo_lambda: float = 0.1
    """ORPO: the weight of the odds-ratio term beside the chosen answer's NLL."""
    label_smoothing: float = 0.0
    """DPO (sigmoid): the assumed share of pairs whose labels are flipped (conservative DPO),
    0 to below 0.5."""
    reference: Literal["auto", vocabulary.Reference] = "auto"
    """DPO/KTO's reference model: adapters (LoRA/QLoRA: the same base with the adapters
    disabled, no second copy) | precompute (the reference log-probabilities in one
    data-parallel pass before training, cached beside the token cache; no copy held while
    training) | copy (a frozen copy of the starting model on every device) | auto (adapters
    for LoRA and QLoRA, precompute for a full fine-tune)."""
    distribution: Distribution = "auto"
    """auto (the planner picks) | ddp | zero1 | fsdp-grad-op | fsdp-full."""
    micro_batch: int = 4
    """Sequences per device per forward pass."""
    grad_accum: int = 1
    """Micro-steps accumulated before each optimizer step."""
    max_steps: int = 0
    """Optimizer steps to run; 0 means use `epochs`."""
    epochs: float = 1.0
    """Passes over the data, used when max_steps is 0."""
    lr: float = 3e-4
    """Peak learning rate, for the preset's effective batch."""
    lr_scaling: Literal["none", "linear", "sqrt"] = "none"
    """Scale lr when the effective batch differs from `reference_batch`: none | linear | sqrt."""
    reference_batch: int = 0
    """The effective batch `lr` was tuned for (0: the effective batch of this preset as planned)."""
    warmup_steps: int = 0
    """Linear warm-up steps before the cosine decay."""
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to lr × min_lr_ratio."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    optimizer: Optimizer = "adamw"
    """adamw | adamw8bit (bitsandbytes) | sgd."""
    activation_checkpointing: AutoBool = "auto"
    """auto (the planner turns it on when that makes the run fit) | true | false."""
    offload: Offload = "auto"
    """FSDP only: keep state in host RAM instead of on the cards. none | optimizer (the
    optimizer state lives in host memory and the optimizer step runs on the CPU) | params
    (FSDP2's CPU offload: the sharded weights, gradients and optimizer state live in pinned host
    memory, copied to the card for each forward and backward; the step runs on the CPU) | auto
    (the planner offloads only when nothing without offload fits). Costs PCIe traffic every
    step; the plan shows how much and the expected slowdown."""
    offload_activations: AutoBool = "auto"
    """Keep the activations saved for backward in pinned host RAM (copied back as backward
    needs them): for long contexts. With activation checkpointing only each layer's input is
    saved, and offloaded. auto: the planner turns it on only when nothing else fits."""
    tiled_mlp: Literal["auto", "on", "off"] = "auto"
    """Compute each decoder layer's MLP in tiles along the sequence, each tile recomputed in
    backward, so the MLP's intermediate activation is one tile's, not the whole sequence's
    (exact: the same loss and gradients). auto: the planner turns it on when the sequence is
    long enough for it to matter | on | off."""
    sequence_parallel: Literal["auto"] | int = 1
    """Split every sequence over this many ranks (Ulysses-style all-to-all over attention
    heads); the world is data ranks × sequence ranks. 1: off | N: a divisor of the world size,
    the sequence length and the attention heads | auto: the planner splits a sequence only
    when it does not fit one card."""
    seed: int = 42
    """Seeds the model init of adapters, dropout and the global sample order."""
    checkpoint_every: int = 0
    """Save a resumable checkpoint every N optimizer steps (0: only at a stop and the end)."""
    keep_checkpoints: int = 2
    """How many complete checkpoints to keep."""
    log_every: int = 1
    """Write a step event every N optimizer steps."""
    eval_every: int = 0
    """With eval data: evaluate every N optimizer steps and at the end (0: only at the end)."""
    keep_best: bool = False
    """With eval data: also keep the checkpoint of the lowest eval loss (checkpoints/BEST names
    its step; keep_checkpoints never prunes it). A step that was no checkpoint step gets one."""
    early_stopping_patience: int = 0
    """With eval data: end the run (as completed, result saved) once the eval loss has not
    improved for this many evaluations in a row; 0 turns it off."""
    merge: bool = False
    """LoRA/QLoRA: also write the adapter merged into the base model (final/merged)."""
    watchdog_s: int = 600
    """Seconds without progress (no rank starting a micro-step) before the run's keeper ends it
    as stalled, naming the rank; 0 turns the watchdog off. Checkpoints, saving the result and
    merging an adapter beat every second while they last, so only the slowest micro-step needs
    to fit under it."""
    collective_timeout_s: int = 0
    """Seconds a collective (all-reduce, barrier) waits for the other ranks before it fails the
    run; 0: 60 on the CPU, 600 on CUDA."""
    compile: AutoBool = "auto"
    """torch.compile each decoder layer (CUDA). auto: on for full and LoRA fine-tunes on CUDA
    when Triton is installed, falling back to eager where a layer cannot be compiled; off on
    the CPU and for QLoRA. true: compile, and fail on an error; false: eager. The first steps
    are slower while the layers compile (seconds to a few minutes)."""
    deterministic: bool = False
    """CUDA: deterministic kernels (torch.use_deterministic_algorithms, cuDNN deterministic and
    not benchmarking, CUBLAS_WORKSPACE_CONFIG=:4096:8), for bitwise resume on the same cards;
    some kernels get slower and an op without a deterministic kernel fails the run. The CPU is
    exact without it."""
    sample_every: Literal["eval", "off"] | int = "eval"
    """Generate an answer to each of `data.sample_prompts` every N optimizer steps and at the
    end (rank 0, the model being trained, no change to what it learns): "eval" with each
    evaluation (none without eval data), "off" never."""
    sample_max_tokens: int = 48
    """The most new tokens of one sample."""
    sample_temperature: float = 0.0
    """0: greedy; above 0: sampled with a generator seeded by train.seed and the step."""
    bench_tasks: list[str] = field(default_factory=list)
    """lm-evaluation-harness tasks (names, or paths of task .yaml files) to run on the result
    when the run completes (`homelab-dp bench`); [] for none. Checked before the run starts."""
    bench_trust_code: bool = False
    """Let the task files of bench_tasks run Python code (``!function``, a ``class``, a custom
    dataset, an ``hf_evaluate`` or file metric, unsandboxed templates), as `bench
    --trust-task-code` does; off: such a file is refused before the run starts."""


@dataclass
class SweepSection:
    """A grid of preset values for `homelab-dp sweep` (every point is planned, then queued)."""

    grid: dict[str, list[str | int | float | bool]] = field(default_factory=dict)
    """Dotted preset keys and the values each takes, e.g. {"train.lr" = [1e-4, 2e-4],
    "lora.r" = [8, 16]}; the sweep runs every combination ({} : no sweep)."""


@dataclass
class LoraSection:
    """LoRA adapters (used when the method is lora or qlora)."""

    r: int = 16
    """Adapter rank."""
    alpha: int = 32
    """Scaling numerator: the update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter input."""
    target_modules: str | list[str] = "all-linear"
    """Which layers get adapters: "all-linear" (attention and dense MLP linears; a MoE model's
    experts and router are left alone) or a list of module names. In a MoE model, naming
    "experts" (or "experts.gate_up_proj", "experts.down_proj") adapts the routed experts too,
    fused 3-D expert weights through peft's ``target_parameters``; the router stays frozen."""


@dataclass
class HardwareSection:
    """Where to run."""

    devices: Literal["auto", "cpu"] | list[int] = "auto"
    """auto (every GPU NVML sees, else the CPU) | cpu | a list of GPU indices like [0, 1]."""
    nproc: int = 2
    """Processes when running on the CPU."""


@dataclass
class CostSection:
    """Electricity cost, to price a run's energy."""

    per_kwh: float = 0.0
    """Price of one kWh in your currency (0: not shown)."""
    currency: str = ""
    """Currency label shown beside the price."""


@dataclass
class LogSection:
    """Where a run's curves go besides its own folder."""

    report_to: list[Reporter] = field(default_factory=lambda: ["tensorboard"])
    """Loggers fed by rank 0: "tensorboard" (event files in the run folder's tensorboard/),
    "wandb", "mlflow" (each must be installed; a missing one is an error). [] for none."""
    project: str = ""
    """The W&B project or MLflow experiment name ("" : homelab-dp)."""


@dataclass
class Preset:
    """One fine-tune: model, data, training, adapters, hardware."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    lora: LoraSection = field(default_factory=LoraSection)
    hardware: HardwareSection = field(default_factory=HardwareSection)
    cost: CostSection = field(default_factory=CostSection)
    log: LogSection = field(default_factory=LogSection)
    sweep: SweepSection = field(default_factory=SweepSection)
    grpo: GrpoSection = field(default_factory=GrpoSection)
    source: str = ""
    """The file the preset was read from (not a TOML key)."""

    def to_dict(self) -> dict[str, Any]:
        """The preset as TOML-ready nested dicts (without `source`)."""
        out = dataclasses.asdict(self)
        out.pop("source", None)
        return out


# The sections are defined beside this module; importers take them from here.
__all__ = ["SECTIONS", "CostSection", "DataSection", "GrpoSection", "HardwareSection",
           "LogSection", "LoraSection", "ModelSection", "Preset", "TrainSection", "apply_overrides", "field_docs", "load_preset",
           "parse_override", "preset_from_dict"]  # fmt: skip

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "train": TrainSection,
    "lora": LoraSection,
    "hardware": HardwareSection,
    "cost": CostSection,
    "log": LogSection,
    "sweep": SweepSection,
    "grpo": GrpoSection,
}

# Sizes that must be at least 1 (0 and negatives are rejected); values that must not be negative.
_POSITIVE = {"data.seq_len", "train.micro_batch", "train.grad_accum", "train.log_every",
             "train.keep_checkpoints", "lora.r", "lora.alpha", "hardware.nproc",
             "train.sample_max_tokens"} | grpo_section.POSITIVE  # fmt: skip
_NON_NEGATIVE = {
    "train.max_steps", "train.epochs", "train.warmup_steps", "train.checkpoint_every",
    "train.weight_decay", "train.max_grad_norm", "train.reference_batch", "train.watchdog_s",
    "train.collective_timeout_s", "cost.per_kwh", "lora.dropout", "train.min_lr_ratio",
    "train.sample_temperature", "train.eval_every", "train.early_stopping_patience",
} | grpo_section.NON_NEGATIVE  # fmt: skip
_POSITIVE_FLOAT = {"train.lr"}
_RANGES = {"data.eval_fraction": (0.0, 0.5)}


def _type_name(tp: Any) -> str:
    origin = get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) if isinstance(a, str) else str(a).lower() for a in get_args(tp))
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        return " or ".join(_type_name(a) for a in get_args(tp))
    if origin is list:
        return f"a list of {_type_name(get_args(tp)[0])}"
    if origin is dict:
        return "a table of strings"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, str(tp)
    )


def _check_value(value: Any, tp: Any) -> tuple[bool, Any]:
    """Return (ok, converted) for a TOML value against a type annotation."""
    origin = get_origin(tp)
    if origin is Literal:
        for option in get_args(tp):
            if type(value) is type(option) and value == option:
                return True, value
        return False, value
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        for option in get_args(tp):
            ok, conv = _check_value(value, option)
            if ok:
                return True, conv
        return False, value
    if origin is list:
        if not isinstance(value, list):
            return False, value
        (inner,) = get_args(tp)
        out = []
        for item in value:
            ok, conv = _check_value(item, inner)
            if not ok:
                return False, value
            out.append(conv)
        return True, out
    if origin is dict:  # str keys: [data] columns, [sweep] grid
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            return False, value
        _, inner = get_args(tp)
        out_dict = {}
        for key, item in value.items():
            ok, conv = _check_value(item, inner)
            if not ok:
                return False, value
            out_dict[key] = conv
        return True, out_dict
    if tp is bool:
        return isinstance(value, bool), value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if tp is float:
        if isinstance(value, bool):
            return False, value
        if isinstance(value, (int, float)):
            return True, float(value)
        return False, value
    if tp is str:
        return isinstance(value, str), value
    return False, value


def _non_finite(value: Any) -> bool:
    """Whether ``value`` is, or holds at any depth, a NaN or an infinity."""
    if isinstance(value, float):
        return not math.isfinite(value)
    if isinstance(value, dict):
        return any(_non_finite(v) for v in value.values())
    if isinstance(value, list):
        return any(_non_finite(v) for v in value)
    return False


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)  # the section module's own names resolve the annotations


def preset_from_dict(data: dict[str, Any], source: str = "") -> Preset:
    """Validate nested dicts (as TOML gives them) into a Preset; every problem raised at once."""
    problems: list[str] = []
    sections: dict[str, Any] = {}
    for key in data:
        if key not in SECTIONS:
            problems.append(
                f"unknown section [{key}] (known: {', '.join('[' + s + ']' for s in SECTIONS)})"
            )
    for name, cls in SECTIONS.items():
        raw = data.get(name, {})
        if not isinstance(raw, dict):
            problems.append(f"{name}: expected a [{name}] table, got {type(raw).__name__}")
            sections[name] = cls()
            continue
        hints = _hints(cls)
        values: dict[str, Any] = {}
        for key, value in raw.items():
            dotted = f"{name}.{key}"
            if key not in hints:
                known = ", ".join(hints)
                problems.append(f"{dotted}: unknown key (known in [{name}]: {known})")
                continue
            if _non_finite(value):  # TOML's inf/nan (or 1e999): never a usable setting
                problems.append(f"{dotted}: must be a finite number, got {value!r}")
                continue
            ok, conv = _check_value(value, hints[key])
            if not ok:
                problems.append(f"{dotted}: expected {_type_name(hints[key])}, got {value!r}")
                continue
            if dotted in _POSITIVE and conv < 1:
                problems.append(f"{dotted}: must be at least 1, got {value!r}")
                continue
            if dotted in _NON_NEGATIVE and conv < 0:
                problems.append(f"{dotted}: must not be negative, got {value!r}")
                continue
            if dotted in _POSITIVE_FLOAT and conv <= 0:
                problems.append(f"{dotted}: must be greater than 0, got {value!r}")
                continue
            low, high = _RANGES.get(dotted, (-math.inf, math.inf))
            if dotted in _RANGES and not low <= conv <= high:
                problems.append(f"{dotted}: must be between {low} and {high}, got {value!r}")
                continue
            values[key] = conv
        sections[name] = cls(**values)
    preset = Preset(**sections, source=source)
    problems.extend(_cross_checks(preset, data))
    if problems:
        where = f"{source}: " if source else ""
        first = f"{where}{problems[0]}"
        if len(problems) > 1:
            first += f" (and {len(problems) - 1} more problem{'s' if len(problems) > 2 else ''})"
        raise PresetError(
            first,
            hint="fix each key named; `homelab-dp presets show tiny-demo` shows a valid preset",
            problems=[f"{where}{p}" for p in problems],
        )
    return preset


def _cross_checks(preset: Preset, data: dict[str, Any]) -> list[str]:
    problems = []
    if not preset.model.path and isinstance(data.get("model", {}), dict):
        problems.append("model.path: required (a local Hugging Face model folder or a model id)")
    if not preset.data.path and isinstance(data.get("data", {}), dict):
        problems.append("data.path: required (a data file or folder, or a dataset id)")
    if preset.train.max_steps == 0 and preset.train.epochs <= 0:
        problems.append("train.epochs: must be greater than 0 when train.max_steps is 0")
    devices = preset.hardware.devices
    if isinstance(devices, list):
        if not devices:
            problems.append("hardware.devices: the list of GPU indices is empty")
        elif any(i < 0 for i in devices) or len(set(devices)) != len(devices):
            problems.append(f"hardware.devices: indices must be distinct and >= 0, got {devices}")
    train = preset.train
    every = train.sample_every
    if isinstance(every, int) and not isinstance(every, bool) and every < 1:
        problems.append(f'train.sample_every: must be at least 1, "eval" or "off", got {every}')
    if train.method == "qlora" and train.distribution == "zero1":
        problems.append("train.distribution: qlora runs under ddp, fsdp-grad-op or fsdp-full "
                        "(ZeRO-1 shards only the adapters' tiny optimizer state), got 'zero1'")  # fmt: skip
    sp = train.sequence_parallel
    if isinstance(sp, int) and not isinstance(sp, bool) and sp < 1:
        problems.append(f'train.sequence_parallel: must be at least 1 (1: off) or "auto", got {sp}')
    if train.offload in ("optimizer", "params"):
        if train.distribution in ("ddp", "zero1"):
            problems.append(f"train.offload = {train.offload!r} needs FSDP: set train.distribution "
                            f"= 'fsdp-grad-op', 'fsdp-full' or 'auto', got {train.distribution!r}")  # fmt: skip
        if train.optimizer != "adamw":
            problems.append(f"train.offload = {train.offload!r} steps AdamW in host memory: set "
                            f"train.optimizer = 'adamw', got {train.optimizer!r}")  # fmt: skip
    return problems + _objective_checks(preset) + _eval_checks(preset) + grpo_checks(preset)


def _objective_checks(preset: Preset) -> list[str]:
    """The preference objective's fields against each other and the method (each problem one
    line naming the key and what would do)."""
    t = preset.train
    out = []
    if t.objective in ("dpo", "kto") and t.reference == "adapters" and t.method == "full":
        out.append("train.reference = 'adapters' needs LoRA or QLoRA (the base with the adapters "
                   "disabled), but train.method = 'full' has no adapters: set train.reference = "
                   "'precompute', 'copy' or 'auto', or train.method = 'lora'")  # fmt: skip
    if t.objective in ("dpo", "kto") and t.reference == "copy":
        if t.method in ("lora", "qlora"):
            out.append(f"train.reference = 'copy' is for a full fine-tune: with train.method = "
                       f"{t.method!r} the reference is the base with the adapters disabled (set "
                       "train.reference = 'adapters' or 'auto')")  # fmt: skip
        if t.distribution in ("fsdp-grad-op", "fsdp-full"):
            out.append(f"train.reference = 'copy' needs an unsharded model, but "
                       f"train.distribution = {t.distribution!r} shards it: set "
                       "train.reference = 'precompute', or train.distribution = 'ddp' or 'auto'")  # fmt: skip
    if t.beta <= 0:
        out.append(f"train.beta: must be greater than 0 (the reward's temperature; 0.1 is "
                   f"usual), got {t.beta}")  # fmt: skip
    if not 0 <= t.label_smoothing < 0.5:
        out.append(f"train.label_smoothing: must be at least 0 and below 0.5 (the share of "
                   f"pairs assumed flipped), got {t.label_smoothing}")  # fmt: skip
    if t.orpo_lambda < 0:
        out.append(f"train.orpo_lambda: must not be negative (the odds-ratio term's weight; "
                   f"0.1 is usual), got {t.orpo_lambda}")  # fmt: skip
    if t.dpo_loss == "ipo" and t.label_smoothing > 0:
        out.append(f"train.label_smoothing: the ipo loss has no label smoothing (conservative "
                   f"DPO is the sigmoid loss's), got {t.label_smoothing} with train.dpo_loss = "
                   "'ipo': set it to 0 or train.dpo_loss = 'sigmoid'")  # fmt: skip
    return out


def _eval_checks(preset: Preset) -> list[str]:
    """Validation: one source of eval data, and the fields that need one only with it."""
    d, t = preset.data, preset.train
    if d.eval_path and d.eval_fraction > 0:
        both = f"both set ({d.eval_path!r} and {d.eval_fraction})"
        return [f"data.eval_path and data.eval_fraction: {both}; evaluate on one or the other"]
    if d.eval_path or d.eval_fraction > 0:
        return []
    asked = {"train.eval_every": t.eval_every, "train.keep_best": t.keep_best,
             "train.early_stopping_patience": t.early_stopping_patience}  # fmt: skip
    return [f"{key}: set to {str(v).lower()}, but there is no eval data (set data.eval_path "
            "or data.eval_fraction)" for key, v in asked.items() if v]  # fmt: skip


def load_preset(path: str | Path) -> Preset:
    """Read and validate a preset file. Raises PresetError naming the file and key."""
    p = Path(path)
    if not p.is_file():
        raise PresetError(
            f"{p}: no such preset file", hint="`homelab-dp presets list` shows the known presets"
        )
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise PresetError(
            f"{p}: not valid TOML: {exc}", hint="check the quoting and brackets on that line"
        ) from None
    except UnicodeDecodeError:
        raise PresetError(f"{p}: not a UTF-8 text file", hint="a preset is a TOML file") from None
    return preset_from_dict(data, source=str(p))


def parse_override(text: str) -> tuple[str, Any]:
    """Parse one ``--set section.key=VALUE``; VALUE is read as a TOML value, else as a string."""
    if "=" not in text:
        raise PresetError(
            f"--set {text}: expected KEY=VALUE", hint="e.g. --set train.micro_batch=2"
        )
    key, raw = text.split("=", 1)
    key = key.strip()
    if key.count(".") != 1 or not all(key.split(".")):
        raise PresetError(
            f"--set {text}: the key must be section.key", hint="e.g. --set train.micro_batch=2"
        )
    raw = raw.strip()
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    return key, value


def apply_overrides(preset: Preset, overrides: list[str]) -> Preset:
    """Return a new Preset with ``--set`` overrides applied and validated."""
    if not overrides:
        return preset
    data = preset.to_dict()
    for text in overrides:
        key, value = parse_override(text)
        section, name = key.split(".")
        if section not in SECTIONS:
            raise PresetError(
                f"--set {key}: unknown section [{section}]",
                hint=f"sections are {', '.join(SECTIONS)}",
            )
        if name not in _hints(SECTIONS[section]):
            raise PresetError(
                f"--set {key}: unknown key",
                hint=f"keys in [{section}] are {', '.join(_hints(SECTIONS[section]))}",
            )
        if _hints(SECTIONS[section])[name] is str and not isinstance(value, (str, list, dict)):
            # A text field takes the text typed: a run id prefix (20260101), a commit (1234567)
            # or a date-shaped name is not the number or date TOML reads it as.
            value = text.split("=", 1)[1].strip()
        data[section][name] = value
    return preset_from_dict(data, source=preset.source)


def field_docs() -> dict[str, str]:
    """Each ``section.key`` with the first line of its docstring (for `presets show`, the TUI)."""
    import ast
    import inspect

    docs: dict[str, str] = {}
    for name, cls in SECTIONS.items():
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:], strict=False):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant)
                and isinstance(nxt.value.value, str)
            ):
                docs[f"{name}.{node.target.id}"] = " ".join(nxt.value.value.split())
    return docs
