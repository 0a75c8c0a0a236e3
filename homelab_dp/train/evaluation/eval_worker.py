"""The evaluation worker: one process per rank, started by torchrun (never by hand).

    torchrun … -m homelab_dp.train.evaluation.eval_worker JOB_FILE

`homelab_dp.app.evaluate` writes JOB_FILE (its module docstring lists the keys) and starts
torchrun. Each rank joins the group (gloo on the CPU, nccl on ``cuda:LOCAL_RANK``), tokenizes
the data with the data pipeline (one sample per row, truncated to ``seq_len``: the front end
checked the same), loads the model — a full folder, or a base with its PEFT adapter on top (no
merge) — puts the chunked loss head in place of lm_head (no full logits; full cross-entropy
where the model changes its logits after lm_head) and runs `train.evaluation.eval_worker.evaluate` on each
group of samples of about one length (`length_groups`: less padding computed, the same sums).
Rank 0 writes the result as JSON to ``result_path``.

Weights compute in fp32 on the CPU; on CUDA in the run's preset dtype where it names one, else
bf16 from compute capability 8.0 (Ampere) on and fp16 before it (a bf16 preset on an older card
falls back to fp16), the rule `homelab_dp.serving.replica.result_model` follows for generation. A QLoRA
result (job ``quantized``: ``nf4``) is evaluated on the base it was trained against, quantized
to NF4 as the run did, wherever bitsandbytes' 4-bit kernels run (CUDA, and the CPU here);
elsewhere on the base in the compute dtype. The result names the base (``base``).

A rank that fails writes ``error_dir/rank-N.json`` (message, hint, whether it was bad input)
before exiting: exit 2 for a `HomelabError`, 1 for anything else.

Data-parallel evaluation: the mean negative log-likelihood per target token over a data set.

Each rank takes every world-th block (rank r: blocks r, r + W, r + 2W, …), sums its token
losses in fp64 and counts its target tokens; one all-reduce of the two sums gives every rank
the same loss. The loss is a sum of per-block sums divided by a count, so it does not depend on
how the blocks were spread: 1 and N processes agree to float rounding of the forward itself.

Every rank runs the same number of forward passes (a rank short of blocks runs one with no
target tokens), because FSDP2 gathers parameters in each forward as a collective. The model is
put in eval mode (no dropout, LoRA dropout included) and back in the mode it was in.

Validation while training: when to evaluate, the best eval loss, and early stopping.

The eval data (``data.eval_path`` or the held-out ``data.eval_fraction``, `homelab_dp.data.eval_split`)
is evaluated every ``train.eval_every`` optimizer steps and at the last step, on every rank
(`homelab_dp.train.evaluation.eval_worker.evaluate`: each rank a shard, the token-weighted sums all-reduced),
so every rank holds the same loss and takes the same decisions without another collective:
whether this is the best loss so far (``train.keep_best`` then keeps its checkpoint) and
whether the loss has gone ``train.early_stopping_patience`` evaluations without improving (the
run then ends as early_stopped: a completed run, result saved). The loop (`train.loop.training_loop`) acts on
the decisions; the state (best loss and step, evaluations since) travels in each checkpoint, so
a resumed run decides as an uninterrupted one would.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from homelab_dp import json_safe
from homelab_dp.data.blocks import IGNORE_INDEX, Block, build_blocks
from homelab_dp.data.samples import load_examples
from homelab_dp.errors import HomelabError
from homelab_dp.nf4_quantization import folder_model_type, nf4_config, nf4_works, quantize_experts
from homelab_dp.peft_targets import exact_targets
from homelab_dp.planning.model_layers import nf4_skip_modules
from homelab_dp.presets.preset import DataSection
from homelab_dp.runs.folder.heartbeats import EVALUATING
from homelab_dp.runs.run_events import EvalEvent
from homelab_dp.train.loop.speed import to_device
from homelab_dp.train.model.attention import attention_implementation
from homelab_dp.train.model.lora import disable_cpu_bf16_repack
from homelab_dp.train.model.loss import install_loss_head, token_loss_sum, unsupported_reason
from homelab_dp.train.model.packed_attention import watch_positions

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
TOKENS_PER_FORWARD = {"cpu": 2048, "cuda": 8192}
"""Tokens per forward pass: the micro-batch is this over the block length (at least 1)."""
FULL_LOGITS_BYTES = 1 << 30
"""The logits one forward may hold where the chunked loss head cannot be used (Gemma-2)."""
GROUP_STEP = 64
"""Samples go through the model in groups of about one length (a multiple of this): short
samples then do not carry the padding of the longest one."""
DTYPE_NAMES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
log = logging.getLogger("homelab_dp.eval_worker")


def eval_dtype(device: torch.device, wanted: str) -> Any:
    """The dtype the weights compute in on ``device`` (see the module docstring)."""
    import torch

    if device.type != "cuda":
        return torch.float32
    bf16_ok = torch.cuda.get_device_capability(device)[0] >= 8
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(wanted)
    if dtype is None:  # auto, or a bare folder
        dtype = torch.bfloat16 if bf16_ok else torch.float16
    return torch.float16 if dtype == torch.bfloat16 and not bf16_ok else dtype


def join_group(kind: str) -> tuple[Any, int, int]:
    """(device, rank, world): gloo on the CPU, nccl on ``cuda:LOCAL_RANK``."""
    import torch
    import torch.distributed as dist

    local_rank = int(os.environ["LOCAL_RANK"])
    # Loading may take a while on one rank; a failed rank ends the group through torchrun.
    kwargs: dict[str, Any] = {"timeout": timedelta(minutes=30)}
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise HomelabError("eval on GPUs, but torch sees no GPU",
                               hint="`homelab-dp doctor` checks torch against the driver")  # fmt: skip
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if kind == "cuda" else "gloo", **kwargs)
    return device, dist.get_rank(), dist.get_world_size()


def load_blocks(job: dict[str, Any], tokenizer: PreTrainedTokenizerBase) -> list[Any]:
    """The data as blocks: one sample per row, truncated to ``seq_len`` (padded to it); the
    samples come from the token cache the front end filled (`homelab_dp.data.samples`)."""

    seq_len = int(job["seq_len"])
    data = DataSection(path=job["data_path"], format=job["format"], seq_len=seq_len, pack=False,
                       split=job.get("split", "train"))  # fmt: skip
    loaded = load_examples(data, tokenizer, seq_len_limit=None, field="--data")
    return build_blocks(loaded.examples, seq_len, False, loaded.pad_id)


def length_groups(blocks: list[Any], step: int = GROUP_STEP) -> list[list[Any]]:
    """The blocks grouped by their real length rounded up to ``step`` (never past the block),
    each cut to its group's width, longest group first (an out-of-memory shows at once).
    Only padding is cut: a sample's tokens, mask and targets are the same."""

    groups: dict[int, list[Any]] = {}
    for b in blocks:
        width = min(len(b.input_ids), -(-sum(b.attention_mask) // step) * step)
        cut = Block(
            b.input_ids[:width], b.labels[:width], b.attention_mask[:width], b.position_ids[:width]
        )
        groups.setdefault(width, []).append(cut)
    return [groups[w] for w in sorted(groups, reverse=True)]


def forward_tokens(model: torch.nn.Module, device_type: str, *, chunked: bool) -> int:
    """Tokens per forward pass: `TOKENS_PER_FORWARD`, fewer where the full logits are made
    (about 8 bytes a logit: the compute dtype and the fp32 copy the cross-entropy takes)."""
    budget = TOKENS_PER_FORWARD[device_type]
    if chunked:
        return budget
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    vocab = int(base.get_output_embeddings().weight.shape[0])
    return max(1, min(budget, FULL_LOGITS_BYTES // (8 * vocab)))


def base_of(job: dict[str, Any], device: torch.device, dtype: torch.dtype) -> str:
    """The base the model computes with: ``nf4`` for a QLoRA result (job ``quantized``) where
    bitsandbytes works on ``device`` (`nf4_works`), else the dtype's name."""
    if job.get("quantized") == "nf4" and job["base_path"] and nf4_works(device.type):
        return "nf4"
    return DTYPE_NAMES[str(dtype)]


def load_model(
    job: dict[str, Any], device: torch.device, dtype: torch.dtype, base_kind: str
) -> Any:
    """The model in eval mode on ``device``: a full folder, or the base with its adapter; the
    base quantized to NF4 as training did when ``base_kind`` is ``nf4``. Loaded in ``dtype``
    and moved with ``.to(device)`` only: rotary ``inv_freq`` and ``_keep_in_fp32_modules``
    stay fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = job["base_path"] or job["model_path"]
    remote = bool(job["trust_remote_code"])
    model_type = AutoConfig.from_pretrained(base, trust_remote_code=remote).model_type
    kwargs: dict[str, Any] = {
        "dtype": dtype,
        "trust_remote_code": remote,
        "attn_implementation": attention_implementation(
            device.type, DTYPE_NAMES[str(dtype)], model_type=model_type
        ),
        "use_safetensors": True,
    }
    if base_kind == "nf4":  # as `train.model.trainable_model.load_model` loads a QLoRA base
        kwargs["quantization_config"] = nf4_config(
            dtype, skip_modules=nf4_skip_modules(folder_model_type(base))
        )
        kwargs["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(base, **kwargs)
    if base_kind == "nf4":  # bitsandbytes converts nn.Linear only: the fused experts as trained
        quantize_experts(model, dtype)
    if job["base_path"]:
        from peft import PeftModel

        with exact_targets(job["model_path"]):
            model = PeftModel.from_pretrained(model, job["model_path"])
    if base_kind != "nf4":  # placed by device_map otherwise
        model.to(device)
    watch_positions(model)  # packed eval blocks of a family like gpt-oss (`packed_attention`)
    if base_kind == "nf4" and device.type == "cpu":
        disable_cpu_bf16_repack(model)  # the kernel the in-run eval computed with
    model.eval()
    model.requires_grad_(False)
    return model


def evaluate_job(job: dict[str, Any]) -> dict[str, Any] | None:
    """Run this rank's share; rank 0 returns the result document, the others None."""
    from transformers import AutoTokenizer

    device, rank, world = join_group(job["device"])
    tokenizer = AutoTokenizer.from_pretrained(job["tokenizer_path"], local_files_only=True,
                                              trust_remote_code=bool(job["trust_remote_code"]))  # fmt: skip
    blocks = load_blocks(job, tokenizer)
    dtype = eval_dtype(device, job["dtype"])
    base_kind = base_of(job, device, dtype)
    model = load_model(job, device, dtype, base_kind)
    head = install_loss_head(model)
    if head is None:
        log.warning("full logits: %s", unsupported_reason(model))
    budget = forward_tokens(model, device.type, chunked=head is not None)
    loss_sum, tokens, real, seconds = 0.0, 0, 0, 0.0
    for group in length_groups(blocks):
        width = len(group[0].input_ids)
        micro = max(1, budget // width)
        log.info("%d samples of at most %d tokens, %d per forward, %s on %s, world %d",
                 len(group), width, micro, dtype, device, world)  # fmt: skip
        part = evaluate(model, eval_blocks(group, packed=False), rank=rank, world=world,
                        micro=micro, device=device, loss_head=head)  # fmt: skip
        loss_sum, tokens = loss_sum + part.loss_sum, tokens + part.tokens
        real, seconds = real + part.real_tokens, seconds + part.seconds
    result = EvalResult(loss_sum, tokens, real, seconds)
    if rank != 0:
        return None
    ppl = result.perplexity
    return {
        "world_size": world,
        "loss": result.loss,
        "perplexity": ppl if ppl != float("inf") else None,
        "tokens": result.tokens,
        "real_tokens": result.real_tokens,
        "tokens_per_s": result.tokens_per_s,
        "seconds": result.seconds,
        "samples": len(blocks),
        "device": device.type,
        "dtype": DTYPE_NAMES[str(dtype)],
        "base": base_kind,
    }


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """Write then rename: the front end never reads half a file."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json_safe.dumps(doc, indent=2), encoding="utf-8")
    tmp.replace(path)


def run_worker(
    argv: list[str] | None, run_job: Callable[[dict[str, Any]], dict[str, Any] | None], what: str,
    hint: str,
) -> int:  # fmt: skip
    """One rank of an eval job under torchrun (the SFT eval here, the pair eval in
    `train.evaluation.pair_evaluation`): read the JOB_FILE, run ``run_job`` on it, rank 0 writes its
    result; a bad input or a crash is written to the job's error folder, named by rank, and
    becomes the exit code. ``what`` and ``hint`` word the refusal of a call outside torchrun."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or any(k not in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")):
        print(f"error: {what} runs under torchrun with one JOB_FILE\nhint: {hint}",
              file=sys.stderr)  # fmt: skip
        return EXIT_BAD_INPUT
    rank = int(os.environ["RANK"])
    logging.basicConfig(level=logging.INFO, format=f"[rank{rank}] %(asctime)s %(message)s")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    job = json.loads(Path(args[0]).read_text(encoding="utf-8"))
    import torch.distributed as dist

    try:
        doc = run_job(job)
        if doc is not None:
            write_json(Path(job["result_path"]), doc)
        dist.barrier()  # leave together: a peer's teardown must not abort rank 0's write
        return EXIT_OK
    except HomelabError as exc:
        error = {"rank": rank, "message": exc.message, "hint": exc.hint, "bad_input": True}
        code = exc.exit_code
        print(f"error: {exc.message}\nhint: {exc.hint}", file=sys.stderr)
    except Exception as exc:  # any crash: say which rank and what, then fail
        error = {"rank": rank, "message": f"{type(exc).__name__}: {exc}", "bad_input": False}
        code = EXIT_FAILED
        traceback.print_exc()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    write_json(Path(job["error_dir"]) / f"rank-{rank}.json", error)
    return code


def main(argv: list[str] | None = None) -> int:
    """Entry point of one rank; returns the process exit code."""
    return run_worker(argv, evaluate_job, "the eval worker",
                      "use `homelab-dp eval MODEL --data FILE`")  # fmt: skip


@dataclass(frozen=True)
class EvalBlocks:
    """Blocks to evaluate, as tensors on the host (every rank holds all of them)."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    """IGNORE_INDEX (-100) where a token is not a target."""
    mask: torch.Tensor
    positions: torch.Tensor
    packed: bool
    """Several samples per block: no mask is passed, the positions restart at each sample."""

    @property
    def n_blocks(self) -> int:
        return int(self.input_ids.shape[0])


def eval_blocks(blocks: list[Any], packed: bool) -> EvalBlocks:
    """`EvalBlocks` from `data.blocks.Block` objects."""
    return EvalBlocks(
        input_ids=torch.tensor([b.input_ids for b in blocks], dtype=torch.long),
        labels=torch.tensor([b.labels for b in blocks], dtype=torch.long),
        mask=torch.tensor([b.attention_mask for b in blocks], dtype=torch.long),
        positions=torch.tensor([b.position_ids for b in blocks], dtype=torch.long),
        packed=packed,
    )


@dataclass(frozen=True)
class EvalResult:
    """The summed loss and target-token count over the whole data set (all ranks)."""

    loss_sum: float
    tokens: int
    """Target tokens (labels that are not ignored)."""
    real_tokens: int
    """Non-padding tokens that went through the model (throughput)."""
    seconds: float

    @property
    def loss(self) -> float:
        """Mean negative log-likelihood per target token (nats)."""
        return self.loss_sum / self.tokens if self.tokens else float("nan")

    @property
    def perplexity(self) -> float:
        """exp(loss); inf where the loss overflows it."""
        loss = self.loss
        return math.exp(loss) if loss < 700 else float("inf")

    @property
    def tokens_per_s(self) -> float:
        return self.real_tokens / self.seconds if self.seconds > 0 else 0.0


def rank_batches(n_blocks: int, rank: int, world: int, micro: int) -> list[list[int]]:
    """This rank's micro-batches of block indices; every rank gets the same number of batches
    (the last ones may be empty lists: a forward with no targets keeps the collectives paired)."""
    mine = list(range(rank, n_blocks, world))
    per_rank = math.ceil(math.ceil(n_blocks / world) / micro) if n_blocks else 0
    return [mine[i * micro : (i + 1) * micro] for i in range(per_rank)]


@torch.no_grad()
def evaluate(
    model: torch.nn.Module,
    blocks: EvalBlocks,
    *,
    rank: int,
    world: int,
    micro: int,
    device: torch.device,
    autocast: Any = contextlib.nullcontext,
    loss_dtype: torch.dtype = torch.float32,
    loss_head: Any = None,
    flat: bool = False,
    split: Any = None,
) -> EvalResult:
    """The loss over ``blocks`` on ``world`` ranks (call it on every rank; all get the result).

    ``model`` is what the forward runs (a strategy's wrapped model, or the bare model);
    ``loss_head`` is the `train.model.loss.ChunkedLossHead` installed in it, or None for full
    cross-entropy; ``flat`` sends a packed micro-batch as one row (FlashAttention varlen).
    ``split`` (`train.parallelism.sequence_parallel.SequenceSplit`): each sequence group takes its data
    rank's blocks and each rank its slice of every sequence, as in training.
    """

    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    tokens = real = 0
    mine = (rank, world) if split is None else (split.data_rank, split.data_world)
    try:
        for idx in rank_batches(blocks.n_blocks, *mine, micro):
            if idx:
                labels = blocks.labels[idx]
            else:  # this rank has no block left: the first block, every label ignored
                idx = [0]
                labels = torch.full_like(blocks.labels[idx], IGNORE_INDEX)
            ids, pos, real_mask = blocks.input_ids[idx], blocks.positions[idx], blocks.mask[idx]
            mask = None if blocks.packed else to_device(real_mask, device)
            scope: Any = contextlib.nullcontext()
            if split is not None:  # this rank's slice; attention sees the whole sequences
                scope = split.active(pos, None if blocks.packed else real_mask)
                ids, pos, labels, real_mask = (
                    split.local(t) for t in (ids, pos, labels, real_mask)
                )
                mask = None
            input_ids, positions = to_device(ids, device), to_device(pos, device)
            if flat:
                input_ids, positions, labels = (
                    t.reshape(1, -1) for t in (input_ids, positions, labels)
                )
            n_targets = int((labels != IGNORE_INDEX).sum())
            targets = (
                loss_head.targets(labels) if loss_head is not None else contextlib.nullcontext()
            )
            with autocast(), targets, scope:
                out = model(input_ids=input_ids, attention_mask=mask, position_ids=positions,
                            use_cache=False).logits  # fmt: skip
            if loss_head is None:
                labels = labels.to(out.device)
            if n_targets:
                loss_sum += token_loss_sum(out, labels, loss_dtype, loss_head).double()
                tokens += n_targets
                real += int(real_mask.sum())
            del out
    finally:
        model.train(was_training)
    totals = torch.tensor([float(tokens), float(real)], dtype=torch.float64, device=device)
    if world > 1:
        import torch.distributed as dist

        both = torch.cat([loss_sum.reshape(1), totals])
        dist.all_reduce(both)
        loss_sum, totals = both[0], both[1:]
    return EvalResult(
        loss_sum=float(loss_sum),
        tokens=int(totals[0]),
        real_tokens=int(totals[1]),
        seconds=time.perf_counter() - t0,
    )


@dataclass(frozen=True)
class PairEvalResult:
    """An objective's figures over the whole preference eval data (all ranks)."""

    loss: float
    """The objective's mean loss (DPO: per pair; ORPO: NLL per chosen token + mean term)."""
    pairs: int
    """Pairs (KTO: completions) evaluated."""
    tokens: int
    """Target tokens of every sequence evaluated."""
    seconds: float
    fields: dict[str, float | None]
    """The objective's event fields besides the loss (rewards, margin, accuracy, nll, ...)."""

    @property
    def perplexity(self) -> float:
        """No perplexity for a preference loss."""
        return float("nan")


def evaluate_pairs(model: Any, pairs: Any, objective: Any, rank: Any) -> PairEvalResult:
    """``objective``'s mean loss and figures over the `PairData` ``pairs`` on every rank (a
    collective): each rank its blocks r, r + W, ... in micro-batches of ``rank.micro``, the
    metric sums and unit counts all-reduced, so every rank has the same result on any world
    size. Eval mode (no dropout), no grad; the model's mode restored after."""
    t0 = time.perf_counter()
    module = model.strategy.model
    was_training = module.training
    module.eval()
    sums: torch.Tensor | None = None
    units = torch.zeros(objective.eval_units(pairs).shape[1] + 1, dtype=torch.float64)
    try:
        with torch.no_grad():
            for idx in rank_batches(pairs.n_blocks, rank.rank, rank.world, rank.micro):
                # A rank short of blocks runs a forward too (FSDP2 gathers as a collective).
                part = objective.eval_sums(model, pairs, torch.tensor(idx or [0]), rank.device)
                if not idx:
                    continue
                sums = part if sums is None else sums + part
                units[:-1] += objective.eval_units(pairs)[idx].sum(0)
                units[-1] += float(pairs.targets[idx].sum())
    finally:
        module.train(was_training)
    if sums is None:
        sums = torch.zeros(len(objective.metrics), dtype=torch.float64, device=rank.device)
    both = torch.cat([sums.to(torch.float64), units.to(sums.device)])
    if rank.world > 1:
        import torch.distributed as dist

        dist.all_reduce(both)
    values = both.tolist()
    n = len(objective.metrics)
    counts = values[n:-1]
    fields = objective.fields(values[:n], counts)
    loss = float(fields.pop("loss") or float("nan"))
    return PairEvalResult(loss=loss, pairs=int(counts[0]), tokens=int(values[-1]),
                          seconds=time.perf_counter() - t0, fields=fields)  # fmt: skip


@dataclass
class Verdict:
    """What one evaluation means for the run."""

    event: EvalEvent
    best: bool
    """The lowest eval loss so far (strictly lower than every earlier one)."""
    stop: bool
    """Early stopping: ``patience`` evaluations in a row without a new best."""


class Validator:
    """One rank's schedule of evaluations and its record of the best eval loss."""

    def __init__(
        self, blocks: Any, every: int, patience: int, *, objective: Any = None, pairs: Any = None
    ) -> None:
        self.blocks = blocks
        """`train.evaluation.eval_worker.EvalBlocks`: every rank holds all of them and evaluates its share."""
        self.objective = objective
        """With ``pairs``: the `train.objectives.objective.Objective` whose loss is evaluated."""
        self.pairs = pairs
        """Preference eval data (`train.objectives.pair_batch.PairData`), or None (SFT)."""
        self.every = every
        self.patience = patience
        self.best_loss: float | None = None
        self.best_step: int | None = None
        self.since_best = 0
        """Evaluations since the best one (early stopping ends the run at ``patience``)."""

    def due(self, step: int, total_steps: int) -> bool:
        """Evaluate after optimizer step ``step``: every ``every`` steps, and at the last."""
        return step == total_steps or (self.every > 0 and step % self.every == 0)

    def evaluate(self, step: int, model: torch.nn.Module, rank: Any, guard: Any) -> Any:
        """The eval loss of the model as trained for ``step`` steps (a collective: every rank
        calls it); every rank beats in the evaluating phase while it lasts, so a long eval is
        no stall for the watchdog."""

        with guard.beating(step, EVALUATING):
            if self.pairs is not None:
                return evaluate_pairs(model, self.pairs, self.objective, rank)
            return evaluate(
                model.strategy.model, self.blocks, rank=rank.rank, world=rank.world,
                micro=rank.micro, device=rank.device, autocast=model.autocast,
                loss_dtype=model.loss_dtype, loss_head=model.loss_head, flat=model.flat_batches,
                split=getattr(rank, "split", None),
            )  # fmt: skip

    def record(self, step: int, result: Any) -> Verdict:
        """Fold one evaluation's `EvalResult` in: the event to write and the decisions."""
        loss = float(result.loss)
        best = not math.isnan(loss) and (self.best_loss is None or loss < self.best_loss)
        if best:
            self.best_loss, self.best_step, self.since_best = loss, step, 0
        else:
            self.since_best += 1
        ppl = result.perplexity
        extra = (
            {"pairs": result.pairs, **result.fields} if isinstance(result, PairEvalResult) else {}
        )
        event = EvalEvent(step=step, loss=loss, perplexity=ppl if math.isfinite(ppl) else None,
                          tokens=int(result.tokens), seconds=float(result.seconds),
                          best=best, **extra)  # fmt: skip
        stop = self.patience > 0 and self.since_best >= self.patience
        return Verdict(event, best, stop)

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (``trainer.json``'s ``eval``)."""
        return {"best_loss": self.best_loss, "best_step": self.best_step,
                "since_best": self.since_best}  # fmt: skip

    def restore(self, state: dict[str, Any] | None) -> None:
        """Take a checkpoint's `state` back (None: a checkpoint of a run without eval data)."""
        if state:
            self.best_loss = state.get("best_loss")
            self.best_step = state.get("best_step")
            self.since_best = int(state.get("since_best") or 0)


if __name__ == "__main__":
    sys.exit(main())
