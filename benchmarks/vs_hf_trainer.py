"""Real (non-pad) tokens/s of homelab-dp against Hugging Face Trainer at its best.

    python benchmarks/vs_hf_trainer.py [--repeats 3] [--steps 20] [--seq-len 512] [--json]
    python benchmarks/vs_hf_trainer.py --only-ours
    python benchmarks/vs_hf_trainer.py --trees old=/tmp/base,new=. --repeats 5

``--only-ours`` runs homelab-dp alone (no HF set-up). ``--trees NAME=PATH,...`` (homelab-dp
alone too) runs it from each of several source trees (``PYTHONPATH=PATH``; e.g. a
``git archive`` of an older commit), interleaved repeat by repeat, as sides
``homelab-dp[NAME]``: an A/B of two versions of the code on the same data, model and machine
load, with each tree's median over the first's.

The same model, the same ragged instruction data, a full fine-tune with AdamW, 2 processes on
the CPU (gloo, OMP_NUM_THREADS = cores / processes), against every way a careful user would run
HF Trainer (`HF_SETUPS`):

- ``hf-defaults``: dynamic padding (``DataCollatorForSeq2Seq``, pad to the longest of a random
  batch) and Trainer's DDP defaults (``find_unused_parameters`` on without gradient
  checkpointing, buffers broadcast every forward);
- ``hf-group-by-length``: ``train_sampling_strategy="group_by_length"`` (batches of similar
  lengths, so little padding), ``ddp_find_unused_parameters=False``,
  ``ddp_broadcast_buffers=False``;
- ``hf-padding-free``: ``DataCollatorWithFlattening`` (a micro-batch is one row of its samples
  end to end, position ids restarting per sample, no padding; transformers' SDPA path builds the
  block-diagonal mask from the position ids) with the same DDP flags.

Runs are interleaved (homelab-dp, then each HF set-up, ``--repeats`` times), and the table gives
the median and min–max of real tokens/s for each, with homelab-dp's median over each set-up's
median and over the best HF set-up's; ``--json`` has every run.

- **data**: seeded, no network. Instruction records whose outputs run from ``--min-words`` to
  ``--max-words`` words, log-uniform (long-tailed like real instruction data: the median is
  the geometric mean), words drawn from the demo tokenizer's own vocabulary (whole-word tokens,
  a quarter of them with a suffix piece), so the token counts are what that tokenizer makes.
- **model**: a LLaMA of the demo family, a little larger than assets/models/tiny-llama (hidden
  256, 4 layers, GQA, the demo tokenizer's 2048 tokens), random weights with a fixed seed,
  saved with safetensors; the tokenizer files are copied from the demo model.
- **homelab-dp**: a preset (full, ddp, fp32, pack = true, no activation checkpointing, no
  checkpoint before the end) run headless through the console script
  (``homelab-dp run PRESET --gpus cpu:2 --json``) in a temporary runs folder. Real tokens are
  the last step event's ``tokens``; padded tokens are steps × effective batch × seq_len (every
  block is seq_len long); the wall time runs from the ``start`` event (written once set-up is
  done, just before the first step) to the last ``step`` event, so it covers every step and
  neither start-up nor the final save.
- **HF Trainer**: this script again under ``torchrun --nproc-per-node 2`` (``--hf-worker``):
  the same records tokenized by homelab-dp's own `tokenize_records` (prompt of
  `format_instruction`, loss on the output and eos only), truncated to seq_len, batched as the
  set-up says (labels -100 on padding and on each flattened sample's first token); same lr, warm-up, cosine to 0.1 of the lr, clipping 1.0, no weight decay, ``adamw_torch``,
  no eval, no saving, a log line every step (as homelab-dp writes a step event every step),
  ``report_to=[]``, no dataloader workers, ``use_cpu``, gloo. Its
  ``training_step`` counts the real (attention mask; every token when flattened) and padded
  (numel) tokens of every micro-batch on every rank; a callback times rank 0 from the first step's begin to the last
  step's end.

Fairness: homelab-dp's micro-batch is in packed blocks of seq_len tokens, HF's in samples, so
HF's per-device batch is micro × seq_len / (mean truncated sample length), rounded: both see
about the same real tokens per optimizer step (the table shows what each processed). The same
gradient accumulation on both sides.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEMO = ROOT / "assets" / "models" / "tiny-llama"
EXE = Path(sys.executable).with_name("homelab-dp")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MODEL_CONFIG = {  # the demo family (see DEMO/config.json), about 5x its compute per token
    "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
    "max_position_embeddings": 1024, "vocab_size": 2048,
    "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "tie_word_embeddings": False,
}  # fmt: skip
MIN_LR_RATIO = 0.1  # homelab-dp's default train.min_lr_ratio
SANE_DDP = {"ddp_find_unused_parameters": False, "ddp_broadcast_buffers": False}
HF_SETUPS: dict[str, dict[str, Any]] = {
    "hf-defaults": {"collator": "pad", "args": {}},
    "hf-group-by-length": {
        "collator": "pad", "args": {"train_sampling_strategy": "group_by_length", **SANE_DDP},
    },
    "hf-padding-free": {"collator": "flatten", "args": dict(SANE_DDP)},
}  # fmt: skip
"""HF Trainer set-ups: the collator (pad to the longest, or flatten) and TrainingArguments."""


# ---------------------------------------------------------------- data (pure, seeded)


def vocabulary_words(vocab: dict[str, int]) -> tuple[list[str], list[str]]:
    """Whole words (byte-level BPE tokens ``Ġword``, letters only) and suffix pieces of a vocab."""
    words = sorted(t[1:] for t in vocab if t.startswith("Ġ") and len(t) > 2 and t[1:].isalpha())
    pieces = sorted(t for t in vocab if len(t) > 1 and t.isalpha() and t.islower())
    return words, pieces


def output_lengths(n: int, lo: int, hi: int, rng: random.Random) -> list[int]:
    """``n`` word counts in [lo, hi], log-uniform: many short answers, a long tail of long ones."""
    return [
        min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))) for _ in range(n)
    ]


def _sentence_text(n: int, words: list[str], pieces: list[str], rng: random.Random) -> str:
    """``n`` words in sentences of 6 to 18, a quarter of the words with a suffix piece."""
    out, left = [], 0
    for i in range(n):
        word = rng.choice(words) + (rng.choice(pieces) if rng.random() < 0.25 else "")
        if left == 0:
            left = rng.randint(6, 18)
        left -= 1
        end = i == n - 1 or left == 0
        out.append(word + ("." if end else "," if rng.random() < 0.08 else ""))
    return " ".join(out)


def ragged_records(
    n: int, words: list[str], pieces: list[str], *, lo: int, hi: int, seed: int
) -> list[dict[str, str]]:
    """Instruction records (instruction, input, output) whose outputs have `output_lengths`."""
    rng = random.Random(seed)
    records = []
    for length in output_lengths(n, lo, hi, rng):
        instruction = _sentence_text(rng.randint(3, 12), words, pieces, rng)[:-1] + "?"
        given = _sentence_text(rng.randint(3, 40), words, pieces, rng) if rng.random() < 0.5 else ""
        output = _sentence_text(length, words, pieces, rng)
        records.append({"instruction": instruction, "input": given, "output": output})
    return records


def write_jsonl(records: list[dict], path: Path) -> None:
    """One JSON object a line."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")


# ---------------------------------------------------------------- model (torch)


def build_model(folder: Path, seed: int) -> int:
    """A random LLaMA of MODEL_CONFIG with the demo tokenizer; returns its parameter count."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" would land amid the table
    torch.manual_seed(seed)
    config = LlamaConfig(
        **MODEL_CONFIG, rope_parameters={"rope_theta": 10000.0, "rope_type": "default"}
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO / name, folder / name)
    return sum(p.numel() for p in model.parameters())


def tokenized(data: Path, model: Path, seq_len: int) -> list[tuple[list[int], list[int]]]:
    """(input_ids, labels) per record as homelab-dp masks them, truncated to seq_len tokens.

    Labels in HF's convention (the model shifts): ``labels[i]`` is the target at position i-1,
    -100 on the prompt. A record left without a target by the truncation is dropped.
    """
    from transformers import AutoTokenizer

    from homelab_dp.data.samples import read_records
    from homelab_dp.data.tokenize import IGNORE_INDEX, tokenize_records

    tokenizer = AutoTokenizer.from_pretrained(model)
    examples = tokenize_records(read_records(data, "instruction"), "instruction", tokenizer)
    cut = [(ex.input_ids[:seq_len], ex.labels[:seq_len]) for ex in examples]
    return [(ids, labels) for ids, labels in cut if any(t != IGNORE_INDEX for t in labels)]


# ---------------------------------------------------------------- homelab-dp side


def preset_toml(model: Path, data: Path, a: argparse.Namespace) -> str:
    """A full, ddp, fp32 preset for 2 CPU processes."""
    return f"""[model]
path = "{model}"
dtype = "fp32"

[data]
path = "{data}"
format = "instruction"
seq_len = {a.seq_len}
pack = true

[train]
method = "full"
distribution = "ddp"
micro_batch = {a.micro}
grad_accum = {a.accum}
max_steps = {a.steps}
lr = {a.lr}
warmup_steps = {warmup(a.steps)}
min_lr_ratio = {MIN_LR_RATIO}
max_grad_norm = 1.0
weight_decay = 0.0
optimizer = "adamw"
activation_checkpointing = false
seed = {a.seed}
checkpoint_every = 0

[hardware]
devices = "cpu"
nproc = {a.nproc}
"""


def warmup(steps: int) -> int:
    """Warm-up steps of both sides: a tenth of the run, at least one."""
    return max(1, steps // 10)


def run_homelab(
    tmp: Path, model: Path, data: Path, a: argparse.Namespace, tree: Path | None = None,
    side: str = "homelab-dp",
) -> dict[str, Any]:  # fmt: skip
    """Run the preset through the CLI and read its figures from events.jsonl; ``tree``: the
    source tree to run homelab-dp from (``PYTHONPATH``), the inherited one when None."""
    preset = tmp / "vs-hf.toml"
    preset.write_text(preset_toml(model, data, a), encoding="utf-8")
    env = {**os.environ, "HOMELAB_DP_RUNS": str(tmp / "runs"), "XDG_DATA_HOME": str(tmp)}
    if tree is not None:
        env["PYTHONPATH"] = str(tree)
    env.pop("HOMELAB_DP_FAULT", None)
    cmd = [str(EXE), "run", str(preset), "--gpus", f"cpu:{a.nproc}", "--json"]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    run_id = next((json.loads(x).get("run_id") for x in out.stdout.splitlines()
                   if x.startswith("{") and '"run_id"' in x), None)  # fmt: skip
    if out.returncode != 0 or run_id is None:
        raise SystemExit(f"homelab-dp run failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    lines = (tmp / "runs" / run_id / "events.jsonl").read_text(encoding="utf-8").splitlines()
    events = [json.loads(x) for x in lines]
    start = next(e for e in events if e["type"] == "start")
    steps = [e for e in events if e["type"] == "step"]
    last = steps[-1]
    return {
        "side": side,
        "steps": last["step"],
        "real_tokens": last["tokens"],
        "padded_tokens": last["step"] * start["tokens_per_step"],
        "wall_s": last["time"] - start["time"],
        "micro_batch": f"{start['micro_batch']} blocks of {start['seq_len']}",
    }


# ---------------------------------------------------------------- HF Trainer side


def run_hf(
    tmp: Path, model: Path, data: Path, a: argparse.Namespace, batch: int, setup: str
) -> dict:
    """This script under torchrun as the HF Trainer worker of ``setup``; sums its ranks'
    counts."""
    out_dir = Path(tempfile.mkdtemp(prefix=f"{setup}-", dir=tmp))
    cfg = {"model": str(model), "data": str(data), "seq_len": a.seq_len, "batch": batch,
           "accum": a.accum, "steps": a.steps, "lr": a.lr, "seed": a.seed, "setup": setup,
           "out": str(out_dir)}  # fmt: skip
    (out_dir / "hf.json").write_text(json.dumps(cfg), encoding="utf-8")
    threads = max(1, (os.cpu_count() or 1) // a.nproc)  # what homelab-dp's launcher sets
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={a.nproc}", str(Path(__file__).resolve()),
           "--hf-worker", str(out_dir / "hf.json")]  # fmt: skip
    out = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"HF Trainer ({setup}) failed ({out.returncode}):\n{out.stderr[-4000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    if len(ranks) != a.nproc:
        raise SystemExit(f"HF Trainer run: {len(ranks)} rank reports of {a.nproc}")
    zero = ranks[0]
    return {
        "side": setup,
        "steps": zero["steps"],
        "real_tokens": sum(r["real_tokens"] for r in ranks),
        "padded_tokens": sum(r["padded_tokens"] for r in ranks),
        "target_tokens": sum(r["target_tokens"] for r in ranks),  # with a loss (--json only)
        "wall_s": zero["wall_s"],
        "micro_batch": f"{batch} samples, "
        + ("flattened, no padding" if HF_SETUPS[setup]["collator"] == "flatten" else "padded"),
    }


def hf_worker(cfg_path: Path) -> None:
    """One rank of the HF Trainer run (under torchrun); writes out/rank<N>.json."""
    import torch
    from transformers import (
        AutoModelForCausalLM,
        AutoTokenizer,
        DataCollatorForSeq2Seq,
        DataCollatorWithFlattening,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    cfg = json.loads(cfg_path.read_text())
    setup = HF_SETUPS[cfg["setup"]]
    rows = tokenized(Path(cfg["data"]), Path(cfg["model"]), cfg["seq_len"])
    dataset = [{"input_ids": ids, "labels": labels, "attention_mask": [1] * len(ids)}
               for ids, labels in rows]  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(cfg["model"])
    model = AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    counts = {"real_tokens": 0, "padded_tokens": 0, "target_tokens": 0}
    clock: dict[str, float] = {}

    class Counting(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):  # noqa: ANN001
            mask = inputs.get("attention_mask")  # none when flattened: every token is real
            counts["real_tokens"] += int(
                mask.sum() if mask is not None else inputs["input_ids"].numel()
            )
            counts["padded_tokens"] += int(inputs["input_ids"].numel())
            counts["target_tokens"] += int((inputs["labels"] != -100).sum())
            return super().training_step(model, inputs, num_items_in_batch)

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            clock.setdefault("first", time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            clock["last"] = time.perf_counter()

    args = TrainingArguments(
        output_dir=cfg["out"], per_device_train_batch_size=cfg["batch"],
        gradient_accumulation_steps=cfg["accum"], max_steps=cfg["steps"],
        learning_rate=cfg["lr"], warmup_steps=warmup(cfg["steps"]),
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": MIN_LR_RATIO},
        weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch", seed=cfg["seed"],
        eval_strategy="no", save_strategy="no", logging_strategy="steps", logging_steps=1,
        report_to=[],
        dataloader_num_workers=0, dataloader_pin_memory=False, remove_unused_columns=False,
        use_cpu=True, ddp_backend="gloo", disable_tqdm=True, **setup["args"],
    )  # fmt: skip
    if setup["collator"] == "flatten":
        collator: Any = DataCollatorWithFlattening(return_position_ids=True, separator_id=-100)
        dataset = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in dataset]
    else:
        collator = DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100)
    trainer = Counting(
        model=model, args=args, train_dataset=dataset, data_collator=collator, callbacks=[Clock()]
    )
    trainer.train()
    rank = int(os.environ.get("RANK", "0"))
    report = {
        **counts,
        "steps": trainer.state.global_step,
        "wall_s": clock["last"] - clock["first"],
    }
    (Path(cfg["out"]) / f"rank{rank}.json").write_text(json.dumps(report))


# ---------------------------------------------------------------- main


def hf_batch(lengths: list[int], micro: int, seq_len: int) -> int:
    """Samples per HF micro-batch holding as many real tokens as ``micro`` full blocks."""
    return max(1, round(micro * seq_len / (sum(lengths) / len(lengths))))


def summarize(runs: list[dict], ours_side: str = "homelab-dp") -> dict[str, dict[str, Any]]:
    """Per side, in first-seen order: the real tokens/s of each repeat, their median, min and
    max, and ``ours_side``'s median over that side's median (``ratio``)."""
    sides: dict[str, list[float]] = {}
    for r in runs:
        sides.setdefault(r["side"], []).append(r["real_tokens"] / r["wall_s"])
    ours = statistics.median(sides[ours_side])
    return {
        side: {"tokens_per_s": rates, "median": statistics.median(rates), "min": min(rates),
               "max": max(rates), "ratio": ours / statistics.median(rates)}
        for side, rates in sides.items()
    }  # fmt: skip


def best_hf(summary: dict[str, dict[str, Any]]) -> str:
    """The HF set-up with the highest median real tokens/s."""
    return max((s for s in summary if s != "homelab-dp"), key=lambda s: summary[s]["median"])


def per_repeat_ratios(runs: list[dict], setup: str) -> list[float]:
    """homelab-dp's real tokens/s over ``setup``'s, repeat by repeat (runs interleaved)."""
    ours = [r["real_tokens"] / r["wall_s"] for r in runs if r["side"] == "homelab-dp"]
    theirs = [r["real_tokens"] / r["wall_s"] for r in runs if r["side"] == setup]
    return [a / b for a, b in zip(ours, theirs, strict=True)]


def table(runs: list[dict], header: str) -> str:
    """The printed table: median and min–max real tokens/s per side, homelab-dp's median over
    each side's median, and over the best HF set-up's."""
    summary = summarize(runs)
    best = best_hf(summary)
    lines = [header, f"{'side':<19} {'runs':>4} {'median tok/s':>12} {'min-max tok/s':>15} "
             f"{'ratio':>6}  micro-batch per device"]  # fmt: skip
    for side, s in summary.items():
        batch = next(r["micro_batch"] for r in runs if r["side"] == side)
        lines.append(f"{side:<19} {len(s['tokens_per_s']):>4} {s['median']:>12.0f} "
                     f"{s['min']:>7.0f}-{s['max']:<7.0f} {s['ratio']:>5.2f}x  {batch}")  # fmt: skip
    ratios = ", ".join(f"{x:.2f}" for x in per_repeat_ratios(runs, best))
    defaults = ", ".join(f"{x:.2f}" for x in per_repeat_ratios(runs, "hf-defaults"))
    lines.append(f"homelab-dp over the best HF set-up ({best}): x{summary[best]['ratio']:.2f} "
                 f"(medians); per repeat {ratios}; over hf-defaults per repeat {defaults}")  # fmt: skip
    return "\n".join(lines)


def parse_trees(text: str) -> dict[str, Path]:
    """``--trees``: ``NAME=PATH,...`` in order (each PATH a source tree holding homelab_dp)."""
    trees: dict[str, Path] = {}
    for item in (x for x in text.split(",") if x):
        name, sep, path = item.partition("=")
        folder = Path(path).expanduser().resolve()
        if not sep or not name or name in trees or not (folder / "homelab_dp").is_dir():
            raise SystemExit(f"--trees: {item!r} is not NAME=PATH with PATH/homelab_dp a folder "
                             "(names unique)")  # fmt: skip
        trees[name] = folder
    return trees


def tree_table(runs: list[dict], header: str) -> str:
    """The A/B table of ``--trees``: median and min–max real tokens/s and mean step time per
    tree, each tree's median over the first's."""
    first = runs[0]["side"]
    summary = summarize(runs, first)
    lines = [header, f"{'side':<22} {'runs':>4} {'median tok/s':>12} {'min-max tok/s':>15} "
             f"{'ms/step':>8} {'vs first':>8}"]  # fmt: skip
    for side, s in summary.items():
        ms = statistics.median(r["wall_s"] / r["steps"] * 1000
                               for r in runs if r["side"] == side)  # fmt: skip
        lines.append(f"{side:<22} {len(s['tokens_per_s']):>4} {s['median']:>12.0f} "
                     f"{s['min']:>7.0f}-{s['max']:<7.0f} {ms:>8.1f} {1 / s['ratio']:>7.3f}x")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs of each side")
    parser.add_argument(
        "--setups",
        default=",".join(HF_SETUPS),
        help=f"HF set-ups, comma-separated (default: all of {', '.join(HF_SETUPS)})",
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps of each side")
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--samples", type=int, default=3000, help="records in the data set")
    parser.add_argument("--micro", type=int, default=4, help="homelab-dp blocks per micro-batch")
    parser.add_argument("--accum", type=int, default=1, help="gradient accumulation (both)")
    parser.add_argument("--min-words", type=int, default=3)
    parser.add_argument("--max-words", type=int, default=300)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only-ours", action="store_true", help="homelab-dp alone, no HF run")
    parser.add_argument(
        "--trees",
        default="",
        help="NAME=PATH,...: homelab-dp from each source tree, interleaved (A/B)",
    )
    parser.add_argument("--json", action="store_true", help="one JSON object instead of a table")
    parser.add_argument("--hf-worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.hf_worker:
        return hf_worker(args.hf_worker)
    args.nproc = 2
    with tempfile.TemporaryDirectory(prefix="vs-hf-") as name:
        tmp = Path(name)
        model, data = tmp / "model", tmp / "ragged.jsonl"
        vocab = json.loads((DEMO / "tokenizer.json").read_text())["model"]["vocab"]
        words, pieces = vocabulary_words(vocab)
        write_jsonl(ragged_records(args.samples, words, pieces, lo=args.min_words,
                                   hi=args.max_words, seed=args.seed), data)  # fmt: skip
        params = build_model(model, args.seed)
        lengths = [len(ids) for ids, _ in tokenized(data, model, args.seq_len)]
        batch = hf_batch(lengths, args.micro, args.seq_len)
        trees = parse_trees(args.trees)
        ours = [f"homelab-dp[{n}]" for n in trees] or ["homelab-dp"]
        alone = args.only_ours or bool(trees)  # an A/B of trees runs homelab-dp alone
        setups = [] if alone else [x for x in args.setups.split(",") if x]
        unknown = [x for x in setups if x not in HF_SETUPS]
        if not alone and (unknown or "hf-defaults" not in setups):
            raise SystemExit(f"--setups: {', '.join(unknown) or 'hf-defaults missing'}; "
                             f"choose among {', '.join(HF_SETUPS)} (hf-defaults included)")  # fmt: skip
        runs: list[dict] = []
        for repeat in range(args.repeats):  # interleaved: ours, then each HF set-up
            for side in (*ours, *setups):
                tree = trees.get(side[len("homelab-dp[") : -1]) if trees else None
                r = (run_homelab(tmp, model, data, args, tree, side) if side in ours
                     else run_hf(tmp, model, data, args, batch, side))  # fmt: skip
                r["repeat"] = repeat
                r["tokens_per_s"] = r["real_tokens"] / r["wall_s"]
                runs.append(r)
                print(f"repeat {repeat + 1}/{args.repeats} {side}: {r['tokens_per_s']:.0f} real "
                      "tok/s", file=sys.stderr, flush=True)  # fmt: skip
    ordered = sorted(lengths)
    header = (f"LLaMA {params / 1e6:.1f}M params, full fine-tune, {args.nproc} CPU processes "
              f"(gloo), {args.steps} steps, seq_len {args.seq_len}, accum {args.accum}, "
              f"{args.repeats} interleaved repeats; {len(lengths)} samples of "
              f"{sum(lengths) / len(lengths):.0f} tokens on average (median "
              f"{ordered[len(ordered) // 2]}, max {ordered[-1]}); "
              f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")  # fmt: skip
    if not setups:  # homelab-dp alone (one tree or several)
        if args.json:
            print(json.dumps({"summary": summarize(runs, ours[0]), "runs": runs}))
        else:
            print(tree_table(runs, header))
        return
    summary = summarize(runs)
    facts = {
        "params": params, "samples": len(lengths), "seq_len": args.seq_len, "steps": args.steps,
        "repeats": args.repeats, "micro": args.micro, "hf_batch": batch,
        "mean_sample_tokens": sum(lengths) / len(lengths),
        "median_sample_tokens": ordered[len(ordered) // 2], "max_sample_tokens": ordered[-1],
        "nproc": args.nproc, "grad_accum": args.accum, "cpus": os.cpu_count(),
        "load_average": os.getloadavg()[0], "best_hf": best_hf(summary),
        "ratio_to_best_hf": summary[best_hf(summary)]["ratio"],
        "ratio_to_hf_defaults": summary["hf-defaults"]["ratio"],
    }  # fmt: skip
    if args.json:
        print(json.dumps({**facts, "summary": summary, "runs": runs}))
        return
    print(table(runs, header))


if __name__ == "__main__":
    main()
