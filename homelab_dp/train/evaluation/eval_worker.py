"""The evaluation worker: one process per rank, started by torchrun (never by hand).

    torchrun … -m homelab_dp.train.evaluation.eval_worker JOB_FILE

`homelab_dp.app.evaluate` writes JOB_FILE (its module docstring lists the keys) and starts
torchrun. Each rank joins the group (gloo on the CPU, nccl on ``cuda:LOCAL_RANK``), tokenizes
the data with the data pipeline (one sample per row, truncated to ``seq_len``: the front end
checked the same), loads the model — a full folder, or a base with its PEFT adapter on top (no
merge) — puts the chunked loss head in place of lm_head (no full logits; full cross-entropy
where the model changes its logits after lm_head) and runs `train.evaluation.eval_loss.evaluate` on each
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
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from homelab_dp import json_safe
from homelab_dp.data.blocks import Block, build_blocks
from homelab_dp.data.samples import load_examples
from homelab_dp.errors import HomelabError
from homelab_dp.nf4_quantization import folder_model_type, nf4_config, nf4_works, quantize_experts
from homelab_dp.peft_targets import exact_targets
from homelab_dp.planning.model_layers import nf4_skip_modules
from homelab_dp.presets.preset import DataSection
from homelab_dp.train.evaluation.eval_loss import EvalResult, eval_blocks, evaluate
from homelab_dp.train.model.attention import attention_implementation
from homelab_dp.train.model.lora import disable_cpu_bf16_repack
from homelab_dp.train.model.loss import install_loss_head, unsupported_reason
from homelab_dp.train.model.packed_attention import watch_positions
from homelab_dp.user_files.private_write import write_whole

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
    write_whole(path, json_safe.dumps(doc, indent=2))


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


if __name__ == "__main__":
    sys.exit(main())
