"""The words of the run contract, spelled once: methods, distributions, dtypes, devices, statuses.

Presets add "auto" to the first three (the planner decides); everything after the plan — the run
spec, the memory model, the worker, the run folder's state — uses only these values. Scripts read
them from `plan --json`, `status --json` and the events: add, never rename.
"""

from __future__ import annotations

from typing import Literal, get_args

Method = Literal["full", "lora", "qlora"]
"""full fine-tune; LoRA adapters on a frozen base; LoRA on a 4-bit base."""
Distribution = Literal["ddp", "zero1", "fsdp-grad-op", "fsdp-full"]
"""DDP; DDP with the optimizer state sharded; FSDP2 keeping weights between forward and backward;
FSDP2 sharding everything."""
Offload = Literal["none", "optimizer", "params"]
"""What FSDP keeps in host RAM: nothing; the optimizer state (the step on the CPU); the sharded
weights, gradients and optimizer state (FSDP2's CPUOffloadPolicy)."""
Objective = Literal["sft", "dpo", "orpo", "kto", "grpo"]
"""What a run trains for: supervised fine-tuning on target tokens; Direct Preference
Optimization on chosen/rejected pairs; ORPO (SFT plus an odds-ratio term on pairs, no
reference); KTO on completions labelled desirable or not; GRPO, online reinforcement learning
on completions the model generates, scored by reward functions (``[grpo]``)."""
Reference = Literal["adapters", "precompute", "copy"]
"""Where DPO/KTO's reference log-probabilities come from: the same base with the LoRA adapters
disabled; one data-parallel pass before training, cached beside the token cache; a frozen copy
of the starting model held during training."""
Dtype = Literal["fp32", "bf16", "fp16"]
Device = Literal["cpu", "cuda"]
Status = Literal["starting", "queued", "running", "stopping", "completed", "failed", "interrupted"]

METHODS: tuple[str, ...] = get_args(Method)
DISTRIBUTIONS: tuple[str, ...] = get_args(Distribution)
SHARDED: tuple[str, ...] = ("fsdp-grad-op", "fsdp-full")
"""The FSDP2 distributions."""
DTYPES: tuple[str, ...] = get_args(Dtype)
OBJECTIVES: tuple[str, ...] = get_args(Objective)
PREFERENCE_OBJECTIVES: tuple[str, ...] = ("dpo", "orpo", "kto")
"""The objectives trained on preference data (pairs, or labelled completions for KTO)."""
REFERENCES: tuple[str, ...] = get_args(Reference)
OFFLOADS: tuple[str, ...] = get_args(Offload)
ACTIVE_STATUSES: tuple[str, ...] = ("starting", "running", "stopping")
"""A run in one of these has processes that may still be alive."""
FINAL_STATUSES: tuple[str, ...] = ("completed", "failed", "interrupted", "stopped")
"""A run in one of these has ended ("stopped" is read from run folders of early versions)."""
EXIT_CODE_BY_STATUS: dict[str, int] = {"completed": 0, "failed": 1, "interrupted": 130}
"""The exit code of a follower (`run`, `attach`, `resume`) when the run ends in this status."""
