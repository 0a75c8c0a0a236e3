"""Setting up one rank, in order: the process group, the data, the model, the resume point.

`set_up` runs the steps every rank runs before its first optimizer step, and `start_event`
describes the result for the ``start`` event. Every rank makes the same collectives in the
same order: the process group, the model wrapper's broadcast, on resume the newest-checkpoint
agreement and the checkpoint load, then the gather of every rank's pid.

Exactness starts here: the global sample order is a permutation of the blocks seeded by
``train.seed`` and the epoch only (`train.parallelism.strategy.SampleOrder`), every rank seeds the model
init identically (identical LoRA init without a broadcast), and a world size other than the
plan's keeps the planned effective batch by changing the accumulation.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from homelab_dp.data.blocks import IGNORE_INDEX
from homelab_dp.data.eval_split import load_preference_train_eval, load_train_eval
from homelab_dp.errors import HomelabError, RunStateError
from homelab_dp.planning.batch_shape import BatchShape
from homelab_dp.planning.recurrent_packing import packing_decision, recurrent_kinds
from homelab_dp.presets.preset import Preset
from homelab_dp.runs.run_events import StartEvent, WarningEvent
from homelab_dp.runs.run_spec import RunSpec
from homelab_dp.train.evaluation.eval_loss import EvalBlocks, eval_blocks
from homelab_dp.train.loop.checkpoints import find_usable, load_checkpoint
from homelab_dp.train.loop.layer_compile import compile_layers, compile_wanted
from homelab_dp.train.loop.memtrack import WorkerMemory
from homelab_dp.train.loop.rank_stats import all_gather_flat, peak_memory_kind
from homelab_dp.train.loop.tf32 import enable_tf32
from homelab_dp.train.model.attention import attention_choice
from homelab_dp.train.model.last_mlp_rows import row_skip_refusal, skip_untargeted_rows
from homelab_dp.train.model.loss import install_loss_head, unsupported_reason
from homelab_dp.train.model.packed_attention import watch_positions
from homelab_dp.train.model.packing_check import check_model
from homelab_dp.train.model.quantized_load import build_on_meta, has_routed_experts
from homelab_dp.train.model.tiled_mlp import tile_mlps
from homelab_dp.train.model.trainable_model import (
    card_capability,
    compute_dtype,
    load_model,
    load_tokenizer,
    master_dtype,
)
from homelab_dp.train.objectives.objective import objective_for
from homelab_dp.train.objectives.pair_batch import pair_data
from homelab_dp.train.objectives.reference import (
    build_reference,
    frozen_copy,
    prepare_precomputed,
    reference_key,
)
from homelab_dp.train.objectives.reference_choice import reference_kind
from homelab_dp.train.parallelism.activation_offload import ActivationOffload
from homelab_dp.train.parallelism.sequence_parallel import CombinedTimer, SequenceSplit, install
from homelab_dp.train.parallelism.strategy import (
    SampleOrder,
    build_optimizer,
    build_scheduler,
    set_lr_for_step,
    wrap_model,
)
from homelab_dp.vocabulary import PREFERENCE_OBJECTIVES, SHARDED

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger("homelab_dp.worker")


@dataclass
class Rank:
    """This process in the group, and the batch geometry every rank agrees on."""

    device: Any
    """The torch.device: ``cuda:LOCAL_RANK`` or the CPU."""
    rank: int
    world: int
    micro: int
    accum: int
    effective: int
    split: Any = None
    """`train.parallelism.sequence_parallel.SequenceSplit` when sequences are split over ranks, else None."""

    @property
    def data_rank(self) -> int:
        """This rank's share of the blocks: its own rank, or its sequence group's."""
        return self.rank if self.split is None else self.split.data_rank

    @property
    def data_world(self) -> int:
        """Ranks that take blocks of their own (the world over the sequence-parallel degree)."""
        return self.world if self.split is None else self.split.data_world


def init_distributed(spec: RunSpec) -> Rank:
    """Join the process group: gloo on the CPU, nccl on CUDA (``cuda:LOCAL_RANK``)."""
    import torch
    import torch.distributed as dist

    resolved = spec.resolved
    local_rank = int(os.environ["LOCAL_RANK"])
    cuda = resolved.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise HomelabError("the spec asks for CUDA but torch sees no GPU", "plan again for cpu")
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    timeout = spec.collective_timeout_s or (600 if cuda else 60)
    kwargs: dict[str, Any] = {"timeout": timedelta(seconds=float(timeout))}
    if cuda:
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    backend = "nccl" if cuda else "gloo"
    if cuda and resolved.offload != "none":
        # Offloaded shards and gradients are host tensors: the gradient norm's all-reduce of
        # them goes over gloo, everything on the cards over NCCL.
        backend = "cuda:nccl,cpu:gloo"
    dist.init_process_group(backend, **kwargs)
    world = dist.get_world_size()
    degree = resolved.sequence_parallel
    if world % degree:
        raise HomelabError(f"train.sequence_parallel = {degree} does not divide the {world} "
                           "processes", hint=f"run with a multiple of {degree} processes")  # fmt: skip
    if degree > 1 and spec.preset.train.objective != "sft":  # the plan refuses it too
        raise HomelabError(f"train.sequence_parallel = {degree} splits SFT sequences only, not "
                           f"train.objective = {spec.preset.train.objective!r}",
                           hint="set train.sequence_parallel = 1")  # fmt: skip
    planned = BatchShape.of(resolved.micro_batch, resolved.world_size, resolved.grad_accum, degree)
    batch = planned
    if world != resolved.world_size:
        # Keep the effective batch (and so the data position and schedule) of the plan.
        rescaled = planned.on_ranks(world // degree)
        if rescaled is None:
            raise HomelabError(
                f"{world} processes cannot keep the planned effective batch "
                f"{planned.effective} with micro-batch {planned.micro}",
                hint=f"run with {resolved.world_size} processes",
            )
        batch = rescaled
        log.warning("world size %d (planned %d): gradient accumulation %d keeps batch %d",
                    world, resolved.world_size, batch.accum, batch.effective)  # fmt: skip
    split = SequenceSplit.create(degree, device) if degree > 1 else None
    if split is not None:
        log.info("sequence parallelism: every sequence split over %d ranks (%d data ranks)",
                 degree, split.data_world)  # fmt: skip
    return Rank(device, dist.get_rank(), world, batch.micro, batch.accum, batch.effective, split)


@dataclass
class Data:
    """The whole data set as tensors (every rank holds it; each takes its own slices)."""

    tokenizer: PreTrainedTokenizerBase
    input_ids: Any
    labels: Any
    mask: Any
    positions: Any
    """Each token's position within its sample (restarting at every sample in packed blocks)."""
    packed: bool
    """Blocks hold several samples: the model gets positions and no mask (transformers then
    builds the block-diagonal causal mask, or FlashAttention's varlen path, from them)."""
    targets: Any
    """Target tokens per block (labels that are not ignored): the loss's denominator."""
    real_tokens: Any
    """Non-padding tokens per block: throughput."""
    n_blocks: int
    fmt: str
    """The data format, ``auto`` resolved (the start event records it)."""
    order: Any
    """The seeded global sample order (`train.parallelism.strategy.SampleOrder`)."""
    total_steps: int
    eval: Any = None
    """`train.evaluation.eval_loss.EvalBlocks` of the eval data (`data.eval_split`), or None without any;
    for preference data its rows (the sample prompts come from them)."""
    pairs: Any = None
    """Preference data (dpo, orpo, kto): `train.objectives.pair_batch.PairData` of the training
    blocks (``input_ids`` & co. are then its rows, for the sample prompts); None for SFT."""
    eval_pairs: Any = None
    """`PairData` of the preference eval data, or None."""
    identical: int = 0
    """Pairs left out because chosen and rejected were the same tokens (`data.preference_blocks`)."""
    prompts: Any = None
    """GRPO: `Prompts` (each block is one prompt), else None."""
    grouped: bool = False
    """Unpacked rows of a model with recurrent layers: each step's blocks grouped by length and
    each micro-batch cut to its longest sample (`train.loop.length_groups`)."""


@dataclass
class Prompts:
    """GRPO's prompts: the records (`homelab_dp.data.prompt_records`) and their token ids."""

    records: list[Any]
    ids: list[list[int]]


def load_data(preset: Preset, rank: Rank) -> Data:
    """The data set in blocks no longer than the model's context; the eval data (its own data
    set, or the samples held out by the seed) in blocks of the same shape. The samples come
    from the token cache the preflight wrote (`homelab_dp.data.token_cache`); a rank that finds
    it missing tokenizes and writes it itself. Each rank logs which it was."""
    import torch
    from transformers import AutoConfig

    tokenizer = load_tokenizer(preset)
    config = AutoConfig.from_pretrained(
        preset.model.path, trust_remote_code=preset.model.trust_remote_code
    )
    limit = getattr(config, "max_position_embeddings", None)
    if preset.train.objective in PREFERENCE_OBJECTIVES:
        return _load_pairs(preset, rank, tokenizer, limit)
    if preset.train.objective == "grpo":
        return _load_prompts(preset, rank, tokenizer)
    split = load_train_eval(preset.data, tokenizer, seed=preset.train.seed, seq_len_limit=limit,
                            min_blocks=rank.data_world * rank.micro)  # fmt: skip
    # hit: read what the preflight wrote; built: tokenized here (the cache was missing)
    names = ("train", "eval")[: len(split.cache)]
    log.info(
        "data: token cache %s",
        ", ".join(f"{u} ({n})" for u, n in zip(split.cache, names, strict=True)),
    )
    blocks = split.train
    labels = torch.tensor([b.labels for b in blocks], dtype=torch.long)
    mask = torch.tensor([b.attention_mask for b in blocks], dtype=torch.long)
    train = preset.train
    total_steps = train.max_steps or max(1, math.ceil(train.epochs * len(blocks) / rank.effective))
    return Data(
        tokenizer=tokenizer,
        input_ids=torch.tensor([b.input_ids for b in blocks], dtype=torch.long),
        labels=labels,
        mask=mask,
        positions=torch.tensor([b.position_ids for b in blocks], dtype=torch.long),
        packed=bool(preset.data.pack),
        targets=(labels != IGNORE_INDEX).sum(1),
        real_tokens=mask.sum(1),
        n_blocks=len(blocks),
        fmt=split.fmt,
        order=SampleOrder(len(blocks), train.seed),
        total_steps=total_steps,
        eval=eval_blocks(split.eval, bool(preset.data.pack)) if split.eval else None,
        grouped=not preset.data.pack and packing_decision(
            False, recurrent_kinds(config.to_dict()), str(config.model_type)
        ).group_by_length,
    )  # fmt: skip


def _load_pairs(preset: Preset, rank: Rank, tokenizer: Any, limit: int | None) -> Data:
    """`load_data` of preference data: `PairData` of the training and eval blocks
    (`data.preference_blocks`), whose rows stand in for SFT's blocks where only rows matter."""
    train = preset.train
    split = load_preference_train_eval(preset.data, tokenizer, objective=train.objective,
                                       seed=train.seed, seq_len_limit=limit,
                                       min_blocks=rank.world * rank.micro)  # fmt: skip
    names = ("train", "eval")[: len(split.cache)]
    log.info("data: token cache %s", ", ".join(f"{u} ({n})" for u, n in zip(split.cache, names,
                                                                         strict=True)))  # fmt: skip
    if split.identical:
        log.warning("%d pair(s) with identical chosen and rejected answers left out (no signal)",
                    split.identical)  # fmt: skip
    packed = bool(preset.data.pack)
    pairs = pair_data(split.train, packed)
    eval_pairs = pair_data(split.eval, packed) if split.eval else None
    width = pairs.input_ids.shape[-1]

    def rows(p: Any) -> Any:
        return EvalBlocks(*(t.reshape(-1, width) for t in (p.input_ids, p.labels, p.mask,
                                                            p.positions)), packed=packed)  # fmt: skip

    flat = rows(pairs)
    n = pairs.n_blocks
    total_steps = train.max_steps or max(1, math.ceil(train.epochs * n / rank.effective))
    return Data(
        tokenizer=tokenizer, input_ids=flat.input_ids, labels=flat.labels, mask=flat.mask,
        positions=flat.positions, packed=packed, targets=pairs.targets,
        real_tokens=pairs.real_tokens, n_blocks=n, fmt=split.fmt,
        order=SampleOrder(n, train.seed), total_steps=total_steps,
        eval=rows(eval_pairs) if eval_pairs is not None else None, pairs=pairs,
        eval_pairs=eval_pairs, identical=split.identical,
    )  # fmt: skip


def prompt_ids(tokenizer: Any, record: Any) -> list[int]:
    """A GRPO prompt's token ids: a chat prompt through the chat template with the generation
    prompt, a text prompt as the tokenizer encodes it (its special tokens included)."""
    if record.chat:
        text = tokenizer.apply_chat_template(record.prompt, tokenize=False,
                                             add_generation_prompt=True)  # fmt: skip
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(record.prompt)["input_ids"])


def _load_prompts(preset: Preset, rank: Rank, tokenizer: Any) -> Data:
    """`load_data` of GRPO: every prompt (`homelab_dp.data.prompt_records`) and its token ids;
    one block per prompt. A prompt longer than data.seq_len tokens is refused."""
    import torch

    from homelab_dp.data.prompt_records import read_prompts

    records = read_prompts(preset.data.path, preset.data.split, preset.data.columns)
    ids = [prompt_ids(tokenizer, r) for r in records]
    seq_len = int(preset.data.seq_len)
    for r, row in zip(records, ids, strict=True):
        if len(row) > seq_len:
            raise HomelabError(f"{r.where}: the prompt is {len(row)} tokens, more than "
                               f"data.seq_len = {seq_len}",
                               hint="raise data.seq_len (the longest prompt) or shorten it")  # fmt: skip
    n = len(records)
    if n < rank.world * rank.micro:
        raise HomelabError(f"data.path: {n} prompt(s) for {rank.world} process(es) of "
                           f"{rank.micro} prompts a micro-step", hint="add prompts")  # fmt: skip
    width = max(len(row) for row in ids)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((n, width), int(pad), dtype=torch.long)
    mask = torch.zeros(n, width, dtype=torch.long)
    for i, row in enumerate(ids):
        input_ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    train = preset.train
    # grpo.iterations optimizer steps on each batch of prompts (`GrpoObjective.repeat`)
    batches = max(1, math.ceil(train.epochs * n / rank.effective)) * int(preset.grpo.iterations)
    total_steps = train.max_steps or batches
    return Data(
        tokenizer=tokenizer, input_ids=input_ids, labels=torch.zeros_like(input_ids),
        mask=mask, positions=torch.arange(width)[None, :].expand(n, -1).contiguous(),
        packed=False, targets=torch.ones(n, dtype=torch.long), real_tokens=mask.sum(1),
        n_blocks=n, fmt="prompt", order=SampleOrder(n, train.seed), total_steps=total_steps,
        prompts=Prompts(records, ids),
    )  # fmt: skip


@dataclass
class Model:
    """What trains: the model in its strategy, the optimizer, the schedule and the precision."""

    loaded: Any
    """`train.model.trainable_model.LoadedModel`: the module, its parameter counts, whether it is PEFT."""
    strategy: Any
    """`train.parallelism.strategy.Strategy`: DDP, ZeRO-1 or FSDP2 around the model."""
    optimizer: Any
    scheduler: Any
    loss_dtype: Any
    scaler: Any
    """A GradScaler for fp16 on CUDA, else None."""
    autocast: Any
    """A context factory: ``torch.autocast`` for bf16/fp16 on CUDA without FSDP2, else a no-op."""
    loss_head: Any = None
    """`train.model.loss.ChunkedLossHead` in place of lm_head (no full logits), or None where the model
    transforms its logits after lm_head (the full cross-entropy then)."""
    flat_batches: bool = False
    """FlashAttention's varlen route: transformers reads the sample boundaries from the positions
    only in a batch of one row, so a packed micro-batch goes in as one row of all its tokens."""
    attention: str = "sdpa"
    """The ``attn_implementation`` the model loaded with (`train.model.attention`)."""
    attention_reason: str = ""
    """Why that kernel, for the start event."""
    packing: Any = None
    """`train.model.packing_check.PackingCheck` of data.pack = true on this model, or None."""
    reference_copy: Any = None
    """``train.reference = "copy"``: the frozen starting model (not with FSDP2), else None."""


def build_model(spec: RunSpec, rank: Rank, total_steps: int, memory: Any = None) -> Model:
    """Load the model, wrap it in its strategy, build the optimizer, schedule and precision.

    ``memory`` (`train.loop.memtrack.WorkerMemory`): a measure run counts the loaded weights from the
    moment they exist (`_count_loaded`).
    """
    import torch

    resolved, train, device = spec.resolved, spec.preset.train, rank.device
    # Same seed on every rank: identical LoRA init without relying on a broadcast.
    torch.manual_seed(train.seed)
    random.seed(train.seed)
    # FSDP2 loads sharded: the model on meta, rank 0 alone reading the weights (train.model);
    # QLoRA's 4-bit weights are quantized as rank 0 reads them (train.quantized_load).
    sharded = resolved.distribution in SHARDED
    if resolved.method == "qlora" and (sharded or has_routed_experts(spec.preset)):
        loaded = build_on_meta(spec.preset, resolved, compute_dtype(resolved))
        if not sharded:
            # DDP QLoRA of a MoE model streams too: from_pretrained would hold every fused
            # expert stack in 16-bit on the card before they are quantized (bitsandbytes only
            # converts nn.Linear as it loads). Each rank gets the whole 4-bit model, broadcast
            # tensor by tensor as rank 0 reads and quantizes it.
            loaded.materializer(loaded, device)
            loaded.on_meta, loaded.materializer = False, None
    else:
        loaded = load_model(spec.preset, resolved, device, sharded=sharded)
    _count_loaded(memory, loaded)
    if resolved.tiled_mlp:  # the planner's decision (`planning.memory.mlp_tiles`)
        hidden = int(loaded.model.config.get_text_config().hidden_size)
        n = tile_mlps(loaded.decoder_layers, hidden)
        log.info("train.tiled_mlp: %d decoder layers' MLPs in tiles of ~%d tokens", n, hidden)
    # homelab_packed finds a packed block's samples from the forward's position_ids, also in a
    # family whose forward keeps them from the mask builder (gpt-oss).
    watch_positions(loaded.model)
    # Before the wrapper: DDP and FSDP2 then see lm_head's parameters under the same names.
    loss_head = install_loss_head(loaded.model)
    if loss_head is None:
        log.warning("full cross-entropy: %s", unsupported_reason(loaded.model))
    compiling = compile_wanted(train.compile, device.type, resolved.method)
    refusal = row_skip_refusal(
        loaded.model, loaded.decoder_layers, loss_head,
        checkpointing=bool(resolved.activation_checkpointing), compiling=compiling,
        sequence_split=rank.split is not None,
    )  # fmt: skip
    if refusal is None:  # the last layer's MLP on the rows with a loss target only
        skip_untargeted_rows(loaded.decoder_layers[-1], loss_head)
    else:
        log.info("the last layer's MLP runs on every row: %s", refusal)
    copied = None
    if not sharded and reference_kind(spec.preset, resolved.method) == "copy":
        copied = frozen_copy(loaded.model)  # before the wrapper: no DDP hooks on the copy
    if rank.split is not None:  # before the wrapper: attention split in the micro-steps
        install(loaded.model)
    strategy = wrap_model(loaded, resolved, device, grad_accum=rank.accum)
    if rank.split is not None:  # the all-to-alls' seconds join the step's comm_seconds
        strategy.comm = CombinedTimer(strategy.comm, rank.split.timer)
    packing = None
    if spec.preset.data.pack:  # exact on this model, or refused before the first step
        packing = check_model(
            strategy.inner, device=device, dtype=resolved.dtype, fsdp=strategy.is_fsdp
        )
        log.info(
            "data.pack: packed block == samples one by one (max logit diff %.3g)", packing.max_diff
        )
    if compiling:
        n = compile_layers(loaded.decoder_layers, strict=train.compile is True)
        log.info("compiling %d decoder layers (train.compile = %s)", n, train.compile)
    if enable_tf32(device, resolved.dtype):
        log.info("TF32 matmuls for the fp32 parts (compute capability 8.0 or later)")
    optimizer = build_optimizer(strategy, train, resolved.lr, device)
    scheduler = build_scheduler(optimizer, train, total_steps)
    torch.manual_seed(train.seed + rank.rank)  # dropout differs per rank
    scaler = None
    autocast: Any = contextlib.nullcontext
    if device.type == "cuda" and resolved.dtype in ("bf16", "fp16"):
        dtype = torch.bfloat16 if resolved.dtype == "bf16" else torch.float16
        if resolved.dtype == "fp16":
            if strategy.is_fsdp:
                raise HomelabError("fp16 with FSDP2 is not supported", hint="use bf16")
            scaler = torch.amp.GradScaler("cuda")
        if not strategy.is_fsdp:  # FSDP2 casts through its MixedPrecisionPolicy
            autocast = functools.partial(torch.autocast, "cuda", dtype=dtype)
    if resolved.offload_activations:
        autocast = _offloading(autocast, loaded.model, pin=device.type == "cuda")
    attention, why = attention_choice(
        device.type, resolved.dtype, capability=card_capability(device),
        model_type=str(getattr(loaded.model.config, "model_type", "")),
    )  # fmt: skip
    flat = attention == "flash_attention_2" and rank.split is None
    return Model(loaded, strategy, optimizer, scheduler, master_dtype(resolved), scaler, autocast,
                 loss_head=loss_head, flat_batches=flat and spec.preset.data.pack,
                 attention=attention, attention_reason=why, packing=packing,
                 reference_copy=copied)  # fmt: skip


def _offloading(autocast: Any, model: Any, *, pin: bool) -> Any:
    """``train.offload_activations``: the forward's context also sends the activations saved for
    backward to (pinned) host memory, brought back as backward needs it; weights, buffers and
    small tensors stay (`train.parallelism.activation_offload.ActivationOffload`)."""

    offload = ActivationOffload(model, pin=pin)

    @contextlib.contextmanager
    def context() -> Any:
        with autocast(), offload.context():
            yield

    return context


def _count_loaded(memory: Any, loaded: Any) -> None:
    """A measure run's probe counts the loaded weights (and rank 0's source copy) from now on.

    ``from_pretrained`` may map weights straight from the file, where no operator shows them to
    the probe; counted here, they leave the count when freed (the source as it is sent).
    """
    probe = getattr(memory, "probe", None)
    if probe is None:
        return
    models = [m for m in (loaded.model, loaded.source) if m is not None]
    probe.track({"weights": [p for m in models for p in m.parameters()],
                 "buffers": [b for m in models for b in m.buffers()]})  # fmt: skip


@dataclass
class Position:
    """Where training starts: step 0, or a checkpoint's step, tokens and loss."""

    start_step: int = 0
    tokens: int = 0
    resumed_from: str | None = None
    last_loss: float | None = None
    eval_state: dict[str, Any] | None = None
    """The checkpoint's validation record (`train.evaluation.validator.Validator.state`)."""
    objective_state: dict[str, Any] | None = None
    """What the objective saved with the checkpoint (GRPO: the batch its next step reuses)."""


def resume_position(run_dir: Path, rank: Rank, model: Model, events: Any) -> Position:
    """Load the newest complete checkpoint every rank agrees on (step 0, warned, when none)."""

    path, skipped = find_usable(run_dir / "checkpoints")
    for reason in skipped:  # a damaged checkpoint is named, and the one before it used
        log.warning("%s", reason)
        events.write(
            WarningEvent(message=f"{reason}; resuming from {path.name if path else 'step 0'}")
        )
    _agree_on_checkpoint(path, rank.device)
    if path is None:
        log.warning("no complete checkpoint in %s: starting from step 0", run_dir)
        return Position()
    state = load_checkpoint(path, model.strategy, model.optimizer)
    if state["effective_batch"] != rank.effective:
        raise RunStateError(
            f"{path}: saved with effective batch {state['effective_batch']}, "
            f"this run has {rank.effective}",
            hint="resume with the run's own spec (micro × world × accumulation)",
        )
    start_step = int(state["step"])
    model.scheduler.load_state_dict(state["scheduler"])
    set_lr_for_step(model.optimizer, model.scheduler, start_step)
    if model.scaler is not None and state.get("scaler"):
        model.scaler.load_state_dict(state["scaler"])
    log.info("resumed from %s at step %d", path, start_step)
    return Position(start_step, int(state["tokens"]), str(path), state.get("loss"),
                    state.get("eval"), state.get("objective"))  # fmt: skip


def _agree_on_checkpoint(path: Path | None, device: Any) -> None:
    """Every rank must resume from the same step (it differs when nodes share no folder)."""
    import torch
    import torch.distributed as dist

    mine = int(path.name.split("-")[1]) if path else -1
    seen = torch.tensor([mine, -mine], dtype=torch.int64, device=device)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    if int(seen[0]) != -int(seen[1]):
        raise RunStateError(
            f"ranks see different newest checkpoints (steps {-int(seen[1])}..{int(seen[0])})",
            hint="multi-node resume needs the run folder on a filesystem every node shares",
        )


@dataclass
class SetUp:
    """Everything `set_up` made, handed to the loop (`train.loop.training_loop.Trainer`)."""

    rank: Rank
    data: Data
    model: Model
    position: Position
    memory: Any
    """`train.loop.memtrack.WorkerMemory`: probes the memory of the set-up and of chosen steps."""
    objective: Any = None
    """`train.objectives.objective.Objective`: what the loop asks for units, loss and metrics."""
    reference: str | None = None
    """DPO/KTO: where the reference log-probabilities come from (adapters, precompute, copy)."""


def set_determinism(deterministic: bool) -> None:
    """``train.deterministic``: deterministic kernels only, before CUDA starts.

    torch.use_deterministic_algorithms (an op without a deterministic kernel raises), cuDNN
    deterministic and not benchmarking; cuBLAS also needs ``CUBLAS_WORKSPACE_CONFIG``, which the
    launcher puts in the workers' environment (set here too for a worker started otherwise).
    """
    if not deterministic:
        return
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    log.info("deterministic algorithms on (train.deterministic)")


def set_up(spec: RunSpec, run_dir: Path, events: Any, resume: bool) -> SetUp:
    """The process group, the data, the model (memory probed around it), the resume point."""

    set_determinism(spec.preset.train.deterministic)
    rank = init_distributed(spec)
    data = load_data(spec.preset, rank)
    memory = WorkerMemory(spec, rank.device, data.total_steps)
    memory.before_build()
    model = build_model(spec, rank, data.total_steps, memory)
    memory.after_build(model.strategy.inner, model.optimizer)
    # The reference is the starting model's: made (or read) before a resume loads its weights.
    kind = reference_kind(spec.preset, spec.resolved.method)
    reference = build_reference(kind, model, rank, spec.resolved.distribution)
    if kind == "precompute":
        _precompute(spec, rank, data, model)
    position = resume_position(run_dir, rank, model, events) if resume else Position()
    objective = objective_for(spec.preset, method=spec.resolved.method, reference=reference,
                              run_dir=run_dir, start_step=position.start_step)  # fmt: skip
    restore = getattr(objective, "restore_state", None)
    if restore is not None:
        restore(position.objective_state, rank.device)
    return SetUp(rank, data, model, position, memory, objective, kind)


def _precompute(spec: RunSpec, rank: Rank, data: Data, model: Model) -> None:
    """The precomputed reference log-probabilities of the training and eval pairs, from the
    cache or one data-parallel pass (`train.objectives.reference.prepare_precomputed`)."""
    r = spec.resolved
    key = reference_key(spec.preset.model.path, data.pairs, data.eval_pairs,
                        objective=spec.preset.train.objective, dtype=r.dtype,
                        device=rank.device.type, attention=model.attention,
                        method=r.method)  # fmt: skip
    t0 = time.perf_counter()
    use = prepare_precomputed(model, data.pairs, data.eval_pairs, rank, key)
    log.info("reference log-probabilities: %s (%s, %.1f s)", use, key, time.perf_counter() - t0)


def start_event(spec: RunSpec, s: SetUp) -> StartEvent:
    """The ``start`` event: the run as set up, with every rank's pid (one all-gather)."""
    import torch

    rank, r = s.rank, spec.resolved
    pid = torch.tensor([os.getpid()], dtype=torch.int64, device=rank.device)
    pids = torch.empty(rank.world, dtype=torch.int64, device=rank.device)
    all_gather_flat(pids, pid)  # once per run: who is who, for the controller
    per_device = spec.planned_bytes or None
    seq_len = spec.preset.data.seq_len
    return StartEvent(
        run_id=spec.run_id, world_size=rank.world, method=r.method,
        distribution=r.distribution, device=r.device, dtype=r.dtype,
        total_steps=s.data.total_steps, start_step=s.position.start_step,
        resumed_from=s.position.resumed_from, params=s.model.loaded.params,
        trainable_params=s.model.loaded.trainable_params, micro_batch=rank.micro,
        grad_accum=rank.accum, effective_batch=rank.effective, seq_len=seq_len,
        tokens_per_step=rank.effective * seq_len, samples=s.data.n_blocks,
        eval_blocks=s.data.eval.n_blocks if s.data.eval is not None else 0,
        eval_every=spec.preset.train.eval_every, data_format=s.data.fmt,
        pids=pids.tolist(), peak_memory_kind=peak_memory_kind(rank.device),
        estimate=per_device, estimate_bytes=(per_device or {}).get("total"),
        attention=s.model.attention, attention_reason=s.model.attention_reason,
        packing=s.model.packing.verdict if s.model.packing is not None else "off",
        packing_error=s.model.packing.max_diff if s.model.packing is not None else None,
        objective=spec.preset.train.objective, reference=s.reference,
        sequence_parallel=rank.split.degree if rank.split is not None else 1,
    )  # fmt: skip
