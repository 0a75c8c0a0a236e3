"""The memory model against measurement, in this process: one rank, the worker's own step.

Each case writes a seeded random model of a tiny config to a temporary folder and then runs what
the worker runs, through the worker's functions: ``load_model`` (train mode, activation
checkpointing), ``install_loss_head`` (chunked cross-entropy), ``wrap_model`` (DDP on a
one-process gloo group: no wrapper), ``build_optimizer`` (fused AdamW on the CPU),
``build_scheduler``, ``micro_step`` (the token-summed loss, scaled; host labels) inside
``Strategy.accumulate`` and ``optimizer_step`` (clipping, update, zero_grad). Packed cases are
real packed blocks (`data.blocks.build_blocks` on synthetic samples of random lengths: positions
restarting at each sample, a padding run of its own, no attention mask, so transformers builds
its block-diagonal mask); padded cases are one sample per row with their attention mask. The probe is on from
before the model load, like a `homelab-dp measure` run, and the peak over a few steps (so that the
optimizer state exists and DDP has rebuilt its buckets) is compared with the planner's predicted
peak of tensor memory, ``Budget.tensors``. `benchmarks/memory_accuracy.py` prints the grid.
The Mixture-of-Experts families (tiny Qwen3-MoE, Mixtral and gpt-oss) run transformers' default experts
implementation (grouped_mm), so the routed tokens' activations are what the worker's are.
"""

from __future__ import annotations

import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from homelab_dp import json_safe
from homelab_dp.data.blocks import Block, Example, attention_span, build_blocks
from homelab_dp.planning.attention_rule import choose_attention
from homelab_dp.planning.memory.device_memory import Budget, TrainShape, budget
from homelab_dp.planning.model_spec import spec_from_config
from homelab_dp.presets.preset import preset_from_dict
from homelab_dp.runs.run_spec import Resolved
from homelab_dp.train.loop.memtrack import MemoryProbe, model_state
from homelab_dp.train.loop.training_loop import optimizer_step
from homelab_dp.train.model.loss import install_loss_head
from homelab_dp.train.model.trainable_model import load_model
from homelab_dp.train.objectives.sft import micro_step
from homelab_dp.train.parallelism.strategy import build_optimizer, build_scheduler, wrap_model


def _decoder(
    model_type: str,
    architecture: str,
    vocab: int,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    *,
    tied: bool,
    **extra: Any,
) -> dict[str, Any]:
    """A tiny decoder's config.json in the LLaMA naming (``extra``: the family's own keys)."""
    return {"model_type": model_type, "architectures": [architecture], "vocab_size": vocab,
            "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "max_position_embeddings": 512,
            "tie_word_embeddings": tied, **extra}  # fmt: skip


def _gpt2(vocab: int, hidden: int, layers: int, heads: int) -> dict[str, Any]:
    """A tiny GPT-2's config.json (learned positions, LayerNorm, GELU, dropout 0.1, tied)."""
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
            "n_embd": hidden, "n_layer": layers, "n_head": heads, "n_positions": 512}  # fmt: skip


FAMILIES: dict[str, dict[str, Any]] = {
    # LLaMA-style with grouped-query attention, untied lm_head.
    "llama-gqa": _decoder("llama", "LlamaForCausalLM", 4096, 128, 3, 4, 2, tied=False,
                          intermediate_size=352),
    # Qwen2-style: tied embeddings, q/k/v biases.
    "qwen2-tied": _decoder("qwen2", "Qwen2ForCausalLM", 6000, 96, 2, 4, 2, tied=True,
                           intermediate_size=256),
    # Qwen3-MoE: 8 fused experts per layer, top-2 (transformers' grouped_mm experts), q/k norms.
    "qwen3-moe": _decoder("qwen3_moe", "Qwen3MoeForCausalLM", 4096, 128, 3, 4, 2, tied=False,
                          intermediate_size=256, moe_intermediate_size=96, num_experts=8,
                          num_experts_per_tok=2, head_dim=32),
    # Mixtral: 4 experts, top-2, untied (its 4096-token sliding window is longer than any block).
    "mixtral": _decoder("mixtral", "MixtralForCausalLM", 3000, 96, 2, 4, 2, tied=False,
                        intermediate_size=160, num_local_experts=4, num_experts_per_tok=2),
    # gpt-oss: 4 experts with biases and the clamped gate, top-2, attention sinks, a sliding layer.
    "gpt-oss": _decoder("gpt_oss", "GptOssForCausalLM", 3000, 96, 2, 4, 2, tied=False,
                        intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                        head_dim=24, layer_types=["sliding_attention", "full_attention"],
                        sliding_window=64),
    # GPT-2 (learned positions, LayerNorm, GELU, dropout 0.1 everywhere, tied lm_head).
    "gpt2": _gpt2(2000, 128, 3, 4),
}  # fmt: skip


LORA_R = 8
"""The adapters' rank in the LoRA cases."""


@dataclass(frozen=True)
class Case:
    """One grid point: a family and a batch geometry (full fine-tune, fp32, DDP, AdamW)."""

    family: str
    micro_batch: int
    seq_len: int
    activation_checkpointing: bool = False
    grad_accum: int = 1
    padded: bool = False
    """pack = false: one sample per row with its attention mask, a quarter of the first row of
    every micro-batch padding. Else packed blocks of several samples (no mask)."""
    method: str = "full"
    """full, or lora (r 8 on the default targets: a MoE model's experts and router frozen)."""

    @property
    def name(self) -> str:
        ck = " ckpt" if self.activation_checkpointing else ""
        acc = f" acc{self.grad_accum}" if self.grad_accum > 1 else ""
        pad = " pad" if self.padded else ""
        lora = " lora" if self.method == "lora" else ""
        return f"{self.family} b{self.micro_batch} s{self.seq_len}{acc}{pad}{ck}{lora}"


GRID: tuple[Case, ...] = tuple(
    Case(fam, b, s, ck, acc)
    for fam in FAMILIES
    for (b, s, acc) in ((1, 64, 1), (1, 256, 1), (4, 64, 1), (4, 128, 1), (2, 128, 2))
    for ck in (False, True)
) + tuple(Case(fam, 4, 128, ck, 1, padded=True) for fam in ("llama-gqa", "qwen2-tied")
          for ck in (False, True)) + tuple(
    Case(fam, b, s, ck, method="lora") for fam in ("qwen3-moe", "mixtral", "gpt-oss")
    for (b, s) in ((1, 64), (4, 128)) for ck in (False, True))  # fmt: skip
"""Every family × five shapes × activation checkpointing off/on, padded batches of the
LLaMA-style families and LoRA on the MoE families (76 cases)."""

HELD_OUT_FAMILIES: dict[str, dict[str, Any]] = {
    # Multi-head attention (no GQA), five heads, wider than any family of the grid.
    "llama-mha": _decoder("llama", "LlamaForCausalLM", 5000, 160, 2, 5, 5, tied=False,
                          intermediate_size=416),
    # Qwen2-style, tied, three query heads per key/value head.
    "qwen2-tied-wide": _decoder("qwen2", "Qwen2ForCausalLM", 3500, 192, 2, 6, 2, tied=True,
                                intermediate_size=512),
    # GPT-2 deeper and narrower, with a small vocabulary (activations outweigh the logits).
    "gpt2-small-vocab": _gpt2(1200, 96, 4, 4),
}  # fmt: skip
"""Families the memory model's measured constants were never fitted on (issue 33 point 5)."""

HELD_OUT_GRID: tuple[Case, ...] = tuple(
    Case(fam, b, s, ck, acc)
    for fam in HELD_OUT_FAMILIES
    for (b, s, acc, ck) in ((2, 160, 1, False), (1, 96, 2, True))
    if not (ck and fam.startswith("gpt2"))  # ~30 s a case on 2 shared cores
)
"""A grid disjoint from `GRID`: other families and other shapes (160 and 96 tokens, two
micro-steps of accumulation with recomputation), to check the constants fitted on `GRID` out
of sample (5 cases)."""


def family_config(family: str) -> dict[str, Any]:
    """The tiny config of ``family``, from the grid's families or the held-out ones."""
    return FAMILIES.get(family) or HELD_OUT_FAMILIES[family]


@dataclass
class Result:
    """Estimate against measurement for one case."""

    case: Case
    estimate: Budget
    measured: int
    measured_phase: str
    phases: dict[str, Any] = field(default_factory=dict)

    @property
    def error(self) -> float:
        """(estimate − measured) / measured: positive when the plan over-estimates."""
        return (self.estimate.tensors - self.measured) / self.measured


def shape_of(case: Case, span: float = 0.0) -> TrainShape:
    """The planner's shape for a case (what `plan` would budget; ``span``: the data's
    `TrainShape.attention_span`, 0 before the data is read)."""
    return TrainShape(
        method=case.method,  # type: ignore[arg-type]
        lora_r=LORA_R, distribution="ddp", world_size=1, device="cpu", dtype="fp32",
        micro_batch=case.micro_batch, seq_len=case.seq_len, grad_accum=case.grad_accum,
        activation_checkpointing=case.activation_checkpointing, optimizer="adamw",
        packed=not case.padded, attention=choose_attention("cpu", "fp32")[0],
        attention_span=span,
    )  # fmt: skip


def estimate(case: Case, steps: int = 2) -> Budget:
    """The planner's budget for a case run for ``steps`` optimizer steps, with the data read (as
    a run records it: the attention span of the blocks it trains on)."""
    cfg = family_config(case.family)
    if case.padded:  # rows of seq_len tokens, the padding in one of them
        span = float(case.seq_len)
    else:
        span = attention_span(packed_rows(case, steps * case.grad_accum, int(cfg["vocab_size"])))
    return budget(spec_from_config(cfg), shape_of(case, span))


@contextlib.contextmanager
def single_rank_group(folder: Path) -> Any:
    """A one-process gloo group (reused when the caller already has one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{folder / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def packed_batches(case: Case, count: int, vocab: int, seed: int = 1) -> tuple[Any, Any, Any]:
    """``count`` micro-batches of packed blocks: (ids, labels, positions), each of shape
    (count, micro_batch, seq_len). Samples of random lengths (an eighth to a half of seq_len,
    every token a target) packed by `build_blocks`: the fullest blocks, and the last micro-batch
    ends with the emptiest one."""
    import torch

    rows = packed_rows(case, count, vocab, seed)
    shape = (count, case.micro_batch, case.seq_len)
    ids, labels, positions = (
        torch.tensor([getattr(b, f) for b in rows]).reshape(shape)
        for f in ("input_ids", "labels", "position_ids")
    )
    return ids, labels, positions


def packed_rows(case: Case, count: int, vocab: int, seed: int = 1) -> list[Block]:
    """The blocks of `packed_batches`, in order (``count × micro_batch`` of them)."""
    import random

    rng, need = random.Random(seed), count * case.micro_batch
    examples: list[Example] = []
    blocks: list[Any] = []
    while len(blocks) < need + 1:
        for _ in range(max(64, 4 * need)):
            n = rng.randint(max(2, case.seq_len // 8), max(3, case.seq_len // 2))
            ids = [rng.randrange(1, vocab) for _ in range(n)]
            examples.append(Example(ids, list(ids)))
        blocks = build_blocks(examples, case.seq_len, pack=True, pad_id=0)
    # The fullest blocks (the planner counts every token as a target), and one with a padding
    # run of its own.
    blocks.sort(key=lambda b: -b.num_targets)
    return blocks[: need - 1] + [blocks[-1]]


def _write_model(cfg: dict[str, Any], folder: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()

    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config.bos_token_id = config.eos_token_id = config.pad_token_id = 0
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def measure_case(case: Case, steps: int = 3) -> Result:
    """Run ``steps`` optimizer steps of ``case`` under the probe; the peak against the estimate."""
    import torch

    cfg = family_config(case.family)
    with tempfile.TemporaryDirectory(prefix="homelab-dp-memcheck-") as tmp:
        folder = Path(tmp)
        _write_model(cfg, folder / "model")
        preset = preset_from_dict({
            "model": {"path": str(folder / "model")},
            "data": {"path": str(folder / "data.jsonl"), "seq_len": case.seq_len,
                     "pack": not case.padded},
            "lora": {"r": LORA_R, "alpha": 2 * LORA_R, "dropout": 0.0},
            "train": {"method": case.method, "distribution": "ddp",
                      "micro_batch": case.micro_batch,
                      "grad_accum": case.grad_accum, "max_steps": steps,
                      "activation_checkpointing": case.activation_checkpointing},
        })  # fmt: skip
        resolved = Resolved(method=case.method, distribution="ddp",  # type: ignore[arg-type]
                            activation_checkpointing=case.activation_checkpointing,
                            device="cpu", world_size=1, dtype="fp32",
                            micro_batch=case.micro_batch, grad_accum=case.grad_accum,
                            lr=preset.train.lr)  # fmt: skip
        device = torch.device("cpu")
        gen = torch.Generator().manual_seed(1)
        vocab = int(cfg["vocab_size"])
        shape = (steps, case.grad_accum, case.micro_batch, case.seq_len)
        mask: Any = None
        if case.padded:
            ids = torch.randint(0, vocab, shape, generator=gen)
            labels = torch.randint(0, vocab, shape, generator=gen)
            positions = torch.arange(case.seq_len).expand(shape).contiguous()
            mask = torch.ones(shape, dtype=torch.long)
            mask[:, :, 0, -case.seq_len // 4 :] = 0
            labels[:, :, 0, -case.seq_len // 4 :] = -100
        else:
            flat = packed_batches(case, steps * case.grad_accum, vocab)
            ids, labels, positions = (t.reshape(shape) for t in flat)
        probe = MemoryProbe(device)
        with single_rank_group(folder):
            probe.start()
            try:
                loaded = load_model(preset, resolved, device)
                # As the worker's measure run: the loaded weights counted from now on (they
                # may be mapped from the file, where no operator shows them).
                probe.track({"weights": list(loaded.model.parameters()),
                             "buffers": list(loaded.model.buffers())})  # fmt: skip
                head = install_loss_head(loaded.model)  # before the wrapper, as the worker
                strategy = wrap_model(loaded, resolved, device)
                optimizer = build_optimizer(strategy, preset.train, resolved.lr, device)
                scheduler = build_scheduler(optimizer, preset.train, steps)
                probe.state = lambda: model_state(strategy.inner, optimizer)
                probe.mark("load")
                scale = 1.0 / (case.micro_batch * case.seq_len * case.grad_accum)
                for step in range(steps):
                    for k in range(case.grad_accum):
                        with strategy.accumulate(final=k == case.grad_accum - 1):
                            # Copies, as the worker's indexing of its data set makes.
                            m = None if mask is None else mask[step, k].clone()
                            micro_step(strategy, ids[step, k].clone(), m,
                                       labels[step, k].clone(), scale,
                                       autocast=contextlib.nullcontext, loss_dtype=torch.float32,
                                       positions=positions[step, k].clone(), probe=probe,
                                       loss_head=head)  # fmt: skip
                    optimizer_step(strategy, optimizer, scheduler, None, preset.train.max_grad_norm)
                    probe.mark("optimizer")
            finally:
                probe.stop()
    out = probe.to_json()
    return Result(
        case, estimate(case, steps), int(out["peak_bytes"]), out["peak_phase"], out["phases"]
    )


def table(results: list[Result]) -> str:
    """The accuracy table as text: case, estimate, measured, error, phases."""
    mib = 1024**2
    rows = [f"{'case':<30} {'estimate':>10} {'measured':>10} {'error':>7}  peak phase (est/meas)"]
    for r in results:
        rows.append(
            f"{r.case.name:<30} {r.estimate.tensors / mib:>7.2f}MiB {r.measured / mib:>7.2f}MiB "
            f"{100 * r.error:>+6.1f}%  {r.estimate.peak_phase} / {r.measured_phase}"
        )
    worst = max((abs(r.error) for r in results), default=0.0)
    rows.append(f"worst |error| {100 * worst:.1f}% over {len(results)} cases")
    return "\n".join(rows)


def to_json(results: list[Result]) -> str:
    """The same as JSON lines (one case a line)."""
    return "\n".join(
        json_safe.dumps(
            {
                "case": r.case.name,
                "estimate_bytes": r.estimate.tensors,
                "measured_bytes": r.measured,
                "error": r.error,
                "estimate_phase": r.estimate.peak_phase,
                "measured_phase": r.measured_phase,
                "estimate": r.estimate.per_device_bytes(),
                "phases": r.phases,
            }
        )
        for r in results
    )
