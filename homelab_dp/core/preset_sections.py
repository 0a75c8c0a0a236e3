"""The sections of a preset: one dataclass per TOML table, a docstring on every field.

`homelab_dp.core.preset` validates TOML against these; `field_docs` reads the docstrings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from homelab_dp.core import vocabulary

Dtype = Literal["auto", vocabulary.Dtype]
DataFormat = Literal["auto", "text", "completion", "instruction", "chat", "sharegpt"]
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
    [{"from","value"}]}, read as chat) | auto (detected from the first record's keys)."""
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


@dataclass
class TrainSection:
    """How to train."""

    method: Method = "auto"
    """auto (the planner picks) | full | lora | qlora."""
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
    """Which linear layers get adapters: "all-linear" or a list of module names."""


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
    source: str = ""
    """The file the preset was read from (not a TOML key)."""

    def to_dict(self) -> dict[str, Any]:
        """The preset as TOML-ready nested dicts (without `source`)."""
        out = dataclasses.asdict(self)
        out.pop("source", None)
        return out
