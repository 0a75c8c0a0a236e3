"""Validate homelab-dp on one GPU inside ten minutes and print the figures as markdown tables.

    python benchmarks/gpu_validate.py [--budget-s 450] [--steps 8] [--json-out FILE] [--keep DIR]
    python benchmarks/gpu_validate.py --cpu      (the same steps on the CPU, small: tests the script)

Made for a bare card: torch (2.9+) and transformers (4.56+) installed, nothing else but the
wheels carried beside the checkout (docs/gpus.md gives the command and the wheels). Rows, in
this order (`row_list`), each through the command line as a user would run it (``python -c``
into `homelab_dp.cli.main`, the repository on ``PYTHONPATH``), each bounded by what is left of
the time budget; once it is spent, the rest are rows saying so:

1. ``homelab-dp probe --json``: the cards NVML sees. The first card it lists is the card every
   row names (``hardware.devices=[N]``): the probe reads an existing ``CUDA_VISIBLE_DEVICES``
   as CUDA does, so ``CUDA_VISIBLE_DEVICES=3`` runs every row on card 3.
2. The plan against the measured, first, so that the budget always reaches them:
   ``homelab-dp measure`` of a full fine-tune, LoRA and QLoRA of Qwen2-0.5B's layers with random
   weights (assets/configs/qwen2-0.5b, saved as safetensors into a temporary folder) and the
   tiny tokenizer (assets/models/tiny-llama): the config takes the tokenizer's vocabulary size
   (2048) and token ids, so the model has 24 Qwen2-0.5B layers and a small embedding. For each:
   the plan's estimate beside ``torch.cuda.max_memory_allocated`` per phase (load, forward,
   backward, optimizer; the largest rank), tokens/s (median of the step events after the first)
   and MFU = 6 · N · tokens/s / the card's peak dense bf16 FLOPS (`homelab_dp.planning.flops`, by
   name). 6 · N counts the weight-gradient matmuls that LoRA and QLoRA skip (their work is nearer
   4 · N), so their MFU overstates the card's use by about half; memory probes are on during a
   measure, so tokens/s is a little below a plain run's. Then the time model (the demo's
   predicted tokens/s before and after one ``measure``) and QLoRA under FSDP2 on the same model
   (`benchmarks/qlora_fsdp_one_card.py`, in a process group of one): full sharding with nothing,
   the params, the optimizer or the activations offloaded, beside QLoRA loaded whole.
3. The CUDA day-one checks (`benchmarks/cuda_day_one.py`, one row each): the attention the
   worker picks and the route ``homelab_packed`` took (counted), the packing check in the
   card's 16-bit dtype, the rotary ``inv_freq`` dtype after a 16-bit inference load, one hostile
   row in a serving batch failing alone, HostAdamW's pinned bytes against the plan's host line
   (read while the optimizer is alive) and activation offload keeping the weights, device
   order by PCI bus (of the first visible card), MIG mode against nvidia-smi, NF4 experts.
4. ``homelab-dp run tiny-demo`` on the card in bf16 to its end; ``homelab-dp eval`` of it;
   ``homelab-dp serve`` of it in its own process session (the ready line's URL, ``/health``,
   8 concurrent ``/v1/completions``, one streamed chat completion, then SIGTERM: a clean exit
   and no replica pid left, `gpu_validate_steps`); LoRA DPO of the demo (the first loss is ln 2);
   ``homelab-dp doctor --json`` last.

Nothing is imported at module level beyond the standard library: torch and transformers are
imported inside functions, and textual, bitsandbytes, datasets and tomli-w never by this script
nor by the paths its rows run. A row that needs what is absent says so and skips: the QLoRA
rows and the NF4 experts check "bitsandbytes not installed", the serve row "aiohttp missing:
carry its wheel". Without a GPU it prints that none was found and exits 0.
tests/unit/test_gpu_validate.py runs the whole row list on the CPU against stand-in answers
of a bare H200 (``CUDA_VISIBLE_DEVICES=3``, no bitsandbytes), so it works the first time.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if str(Path(__file__).resolve().parent) not in sys.path:  # its helpers beside it, however
    sys.path.append(str(Path(__file__).resolve().parent))  # it was loaded (last: no shadowing)
from gpu_validate_steps import guarded, run_id_of, step_eval, step_serve  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "assets" / "models" / "tiny-llama"
CONFIG = ROOT / "assets" / "configs" / "qwen2-0.5b" / "config.json"
DATA = ROOT / "assets" / "data" / "tiny-text.jsonl"
PHASES = ("load", "forward", "backward", "optimizer")
GiB = 1024**3


@dataclass
class Report:
    """What the script found: one summary row per step, and the measured figures."""

    device: str = ""
    rows: list[tuple[str, str, str]] = field(default_factory=list)
    memory: list[tuple[str, str, str, str, str]] = field(default_factory=list)
    speed: list[tuple[str, str, str, str]] = field(default_factory=list)

    def add(self, check: str, result: str, detail: str = "") -> None:
        self.rows.append((check, result, detail.replace("|", "/").replace("\n", " ")))
        print(f"[{check}] {result}{': ' + detail if detail else ''}", file=sys.stderr, flush=True)

    def markdown(self) -> str:
        parts = [f"### homelab-dp on {self.device}\n",
                 markdown_table(("check", "result", "detail"), self.rows)]  # fmt: skip
        if self.memory:
            parts += ["\n#### Memory: the plan's estimate and the measured peak, per phase "
                      "(largest rank)\n", markdown_table(
                          ("method", "phase", "estimate", "measured", "error"), self.memory)]  # fmt: skip
        if self.speed:
            parts += ["\n#### Throughput\n", markdown_table(
                ("method", "params N", "tokens/s", "MFU (6·N·tokens/s ÷ peak bf16)"), self.speed)]  # fmt: skip
        return "\n".join(parts)


def markdown_table(headers: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def peak_bf16_flops(device_name: str) -> float | None:
    """The card's dense bf16 peak in FLOPS (the worker's table, `homelab_dp.planning.flops`), or
    None for a card not in the table."""
    if str(ROOT) not in sys.path:  # run as a script from a checkout, installed or not
        sys.path.insert(0, str(ROOT))
    from homelab_dp.planning.flops import peak_flops  # pure: no torch

    return peak_flops(device_name)


def mfu(params: int, tokens_per_s: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: 6 · N · tokens/s over the peak (None without a peak)."""
    if not peak_flops or not params or tokens_per_s <= 0:
        return None
    return 6.0 * params * tokens_per_s / peak_flops


def model_config(
    base: dict[str, Any], vocab: int, ids: dict[str, int | None], layers: int | None = None
) -> dict[str, Any]:
    """``base`` (a config.json) with the tokenizer's vocabulary size and special token ids, so
    every id the tokenizer makes is a row of the embedding; ``layers`` shrinks the stack."""
    out = {k: v for k, v in base.items() if k != "torch_dtype"}
    out["vocab_size"] = vocab
    out.update({f"{k}_token_id": v for k, v in ids.items() if v is not None})
    out["max_position_embeddings"] = min(int(base.get("max_position_embeddings", 4096)), 4096)
    if layers:
        out["num_hidden_layers"] = layers
    return out


def median_tokens_per_s(events: list[dict[str, Any]]) -> float | None:
    """The median ``tokens_per_s`` of the step events after the first (warm-up)."""
    rates = [e["tokens_per_s"] for e in events if e.get("type") == "step" and e.get("step", 0) > 1]
    return statistics.median(rates) if rates else None


def memory_rows(method: str, doc: dict[str, Any]) -> list[tuple[str, str, str, str, str]]:
    """Per phase: the estimate (``plan``'s phase tensor bytes) and the largest rank's peak."""
    estimate = (doc.get("estimate") or {}).get("phases") or {}
    rows = []
    for phase in PHASES:
        measured = [r["phases"][phase]["peak_bytes"] for r in doc.get("ranks", [])
                    if phase in r.get("phases", {})]  # fmt: skip
        est, got = estimate.get(phase), max(measured) if measured else None
        error = f"{100 * (est - got) / got:+.1f}%" if est and got else "–"
        rows.append((method, phase, gib(est), gib(got), error))
    return rows


def gib(n: float | None) -> str:
    return f"{n / GiB:.2f} GiB" if n else "–"


# ----------------------------------------------------------------------------- the steps


class Runner:
    """Runs the command line against a private runs folder, within the time budget."""

    def __init__(self, work: Path, budget_s: float) -> None:
        self.work = work
        self.card = 0
        """The NVML index of the card the CLI rows name (``hardware.devices``): the first card
        the probe lists, which honours an existing ``CUDA_VISIBLE_DEVICES`` (`step_probe`)."""
        self.deadline = time.monotonic() + budget_s
        self.env = {**os.environ, "HOMELAB_DP_RUNS": str(work / "runs"),
                    "XDG_DATA_HOME": str(work / "xdg-data"),
                    "XDG_CONFIG_HOME": str(work / "xdg-config"),
                    "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                                os.environ.get("PYTHONPATH")]))}  # fmt: skip

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def devices(self, cpu: bool) -> list[str]:
        """The arguments that put a CLI row on one CPU process or on this run's card, and keep
        TensorBoard out of it where tensorboard is not installed (a bare card's image)."""
        where = ["--gpus", "cpu:1"] if cpu else ["--set", f"hardware.devices=[{self.card}]"]
        return where + ([] if has_module("tensorboard") else ["--set", "log.report_to=[]"])

    def script(self, name: str, *args: str, cap_s: float) -> subprocess.CompletedProcess[str]:
        """``python benchmarks/NAME ARGS`` (a helper script beside this one), bounded by the
        budget; a timeout is exit 124 with what it printed."""
        cmd = [sys.executable, str(Path(__file__).resolve().parent / name), *args]
        timeout = max(30.0, min(cap_s, self.left()))
        try:
            return subprocess.run(cmd, env=self.env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=timeout, check=False)  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return subprocess.CompletedProcess(cmd, 124, out, f"timed out after {timeout:.0f} s")

    def cli(self, *args: str, cap_s: float = 180) -> subprocess.CompletedProcess[str]:
        """``homelab-dp ARGS`` (via python -c, so the repository needs no install)."""
        timeout = max(5.0, min(cap_s, self.left()))
        code = "import sys; from homelab_dp.cli.main import main; sys.exit(main(sys.argv[1:]))"
        try:
            return subprocess.run([sys.executable, "-c", code, *args], env=self.env, cwd=ROOT,
                                  capture_output=True, text=True, timeout=timeout, check=False)  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            return subprocess.CompletedProcess(
                exc.cmd, 124, out, f"timed out after {timeout:.0f} s"
            )


def has_module(name: str) -> bool:
    """Whether ``name`` can be imported here (found, not imported)."""
    return importlib.util.find_spec(name) is not None


def last_line(text: str) -> str:
    lines = [line for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def step_probe(r: Runner, report: Report) -> None:
    out = r.cli("probe", "--json", cap_s=60)
    if out.returncode != 0:
        report.add("probe", "failed", last_line(out.stderr))
        return
    doc = json.loads(out.stdout)
    gpus = doc.get("gpus") or []
    cards = ", ".join(f"{g.get('name')} ({gib(g.get('memory_total'))})" for g in gpus)
    detail = f"{len(gpus)} card(s): {cards}; driver {doc.get('driver_version')}, CUDA " \
             f"{doc.get('cuda_driver_version')}"  # fmt: skip
    if not gpus:
        detail = doc.get("notice") or "NVML lists no card"
    else:
        r.card = first_card(doc)
        detail += f"; the rows use NVML card {r.card}"
    report.add("probe", "ok" if gpus else "no GPU seen by NVML", detail)


def first_card(probe_doc: dict[str, Any]) -> int:
    """The NVML index of the first card ``probe --json`` lists: the probe reads
    ``CUDA_VISIBLE_DEVICES`` as CUDA does, so under ``CUDA_VISIBLE_DEVICES=3`` it is card 3."""
    gpus = probe_doc.get("gpus") or []
    return int(gpus[0].get("index", 0)) if gpus else 0


def step_doctor(r: Runner, report: Report) -> None:
    out = r.cli("doctor", "--json", cap_s=120)
    if out.returncode == 2 and "invalid choice" in out.stderr:
        report.add("doctor", "not in this build", "`homelab-dp doctor` does not exist here")
        return
    try:
        doc = json.loads(out.stdout)
    except json.JSONDecodeError:
        report.add("doctor", f"failed (exit {out.returncode})", last_line(out.stderr))
        return
    checks = doc.get("checks", []) if isinstance(doc, dict) else []
    counts: dict[str, int] = {}
    for c in checks:
        counts[c.get("status", "?")] = counts.get(c.get("status", "?"), 0) + 1
    bad = [f"{c.get('name')}: {c.get('detail')}" for c in checks
           if c.get("status") not in ("ok", "skip")]  # fmt: skip
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    report.add("doctor", summary or f"exit {out.returncode}", "; ".join(bad)[:600])


def step_tiny_demo(r: Runner, report: Report, cpu: bool) -> str | None:
    """The demo to its end; its run id when it left a result (the eval and serve rows use it)."""
    args = ["run", "tiny-demo", "--json", "--set", "train.max_steps=30",
            "--set", "train.checkpoint_every=15"]  # fmt: skip
    args += r.devices(cpu) + ([] if cpu else ["--set", "model.dtype=bf16"])
    t = time.monotonic()
    out = r.cli(*args, cap_s=240)
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    end = next((e for e in reversed(events) if e.get("type") == "end"), None)
    state = next((e for e in reversed(events) if e.get("type") == "state"), None)
    status = (state or {}).get("status") or f"exit {out.returncode}"
    start = next((e for e in events if e.get("type") == "start"), {})
    where = f"{start.get('device')} {start.get('dtype')} × {start.get('world_size')} process"
    if end:
        detail = (f"{where}; {end.get('steps')} steps, loss {end.get('final_loss'):.3f}, "
                  f"{end.get('seconds'):.0f} s in the worker, {time.monotonic() - t:.0f} s "
                  f"end to end")  # fmt: skip
    else:
        detail = (state or {}).get("reason") or last_line(out.stderr)
    report.add("tiny-demo (1 process)", status, detail)
    return run_id_of(events) if end and end.get("final_path") else None


def build_model(folder: Path, device: str, layers: int | None) -> int:
    """Qwen2-0.5B's layers with random bf16 weights and the tiny tokenizer, as safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    ids = {"bos": tok.bos_token_id, "eos": tok.eos_token_id, "pad": tok.pad_token_id}
    cfg = model_config(json.loads(CONFIG.read_text(encoding="utf-8")), len(tok), ids, layers)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    config.architectures = cfg["architectures"]
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the card: seconds instead of a minute
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(folder)  # safetensors
    tok.save_pretrained(folder)
    params = sum(p.numel() for p in model.parameters())
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return params


def write_preset(
    folder: Path, model: Path, method: str, cpu: bool, steps: int, card: int = 0
) -> Path:
    seq_len, micro = (256, 2) if cpu else (1024, 8)
    devices = '"cpu"\nnproc = 1' if cpu else f"[{card}]"
    dtype = "auto" if cpu else "bf16"
    text = f"""# homelab-dp measure {folder / method}.toml --json
[model]
path = "{model}"
dtype = "{dtype}"

[data]
path = "{DATA}"
seq_len = {seq_len}
pack = true

[train]
method = "{method}"
distribution = "ddp"
micro_batch = {micro}
grad_accum = 1
max_steps = {steps}
lr = 1e-4
activation_checkpointing = false

[lora]
r = 16
alpha = 32

[log]
report_to = []

[hardware]
devices = {devices}
"""
    path = folder / f"validate-{method}.toml"
    path.write_text(text, encoding="utf-8")
    return path


def step_measure(r: Runner, report: Report, method: str, model: Path, params: int,
                 cpu: bool, steps: int, peak: float | None) -> None:  # fmt: skip
    name = f"measure {method}"
    if method == "qlora" and not has_module("bitsandbytes"):
        report.add(name, "skipped", "bitsandbytes not installed")
        return
    if r.left() < 45:
        report.add(name, "skipped", "out of the time budget")
        return
    preset = write_preset(r.work, model, method, cpu, steps, r.card)
    args = ["measure", str(preset), "--json", "--no-store", "--steps", str(steps), "--force"]
    out = r.cli(*(args + (["--gpus", "cpu:1"] if cpu else [])), cap_s=200)
    try:
        doc = json.loads(out.stdout)
    except json.JSONDecodeError:
        report.add(name, f"failed (exit {out.returncode})", last_line(out.stderr))
        return
    events_path = Path(doc["run_dir"]) / "events.jsonl"
    events = [json.loads(line) for line in events_path.read_text(encoding="utf-8").splitlines()]
    rate = median_tokens_per_s(events)
    start = next((e for e in events if e.get("type") == "start"), {})
    n = int(start.get("params") or params)
    report.memory += memory_rows(method, doc)
    use = mfu(n, rate or 0.0, peak)
    shown = f"{100 * use:.1f}%" if use is not None else ("n/a (CPU)" if cpu else "n/a (card not "
                                                                                 "in the table)")  # fmt: skip
    report.speed.append((method, f"{n / 1e6:.0f} M", f"{rate:,.0f}" if rate else "–", shown))
    report.add(name, "ok", f"{doc.get('kind')}: estimate {gib(doc['estimate']['tensor_bytes'])}, "
                           f"measured {gib(doc['measured_peak_bytes'])} "
                           f"({100 * doc['error']:+.1f}%), {steps} steps")  # fmt: skip


def step_qlora_fsdp(r: Runner, report: Report, model: Path, cpu: bool) -> None:
    """QLoRA under FSDP2 and each offload mode on one card (`qlora_fsdp_one_card`)."""
    name = "QLoRA-FSDP (one card)"
    if not has_module("bitsandbytes"):
        report.add(name, "skipped", "bitsandbytes not installed")
        return
    if r.left() < 60:
        report.add(name, "skipped", "out of the time budget")
        return
    size = ["--seq-len", "64", "--micro", "2", "--steps", "3"] if cpu else ["--steps", "6"]
    out = r.script("qlora_fsdp_one_card.py", str(model), "--device", "cpu" if cpu else "cuda",
                   "--json", *size, cap_s=300)  # fmt: skip
    try:
        doc = json.loads(out.stdout.strip().splitlines()[-1])
    except (json.JSONDecodeError, IndexError) as exc:
        report.add(name, "failed", f"{type(exc).__name__}: {exc}"[:300])
        return
    worst, failed = 0.0, []
    for row in doc["rows"]:
        if "error" in row:
            failed.append(f"{row['config']}: {row['error']}")
            continue
        worst = max(worst, row.get("max_loss_diff") or 0.0)
        est, got = row.get("estimate_bytes"), row.get("peak_bytes")
        error = f"{100 * (est - got) / got:+.1f}%" if est and got else "–"
        rate = f", {row['tokens_per_s']:,.0f} tokens/s" if row.get("tokens_per_s") else ""
        report.memory.append((f"qlora {row['config']}", "peak" + rate, gib(est), gib(got), error))
    result = "failed" if failed else "ok"
    report.add(name, result, "; ".join(failed) or f"{len(doc['rows'])} configurations, largest "
               f"loss difference from QLoRA loaded whole {worst:.2e}")  # fmt: skip


def step_day_one(r: Runner, report: Report, cpu: bool) -> None:
    """The CUDA day-one checks (`cuda_day_one`): attention chosen and the packing check, the
    inv_freq dtype after a 16-bit load, one bad row in a batch, pinned bytes against the plan's
    host line and activation offload, device order, MIG mode; one row each."""
    if r.left() < 30:
        report.add("CUDA day-one checks", "skipped", "out of the time budget")
        return
    out = r.script("cuda_day_one.py", "--json", "--device", "cpu" if cpu else "cuda", cap_s=240)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if not rows:
        report.add("CUDA day-one checks", "failed", last_line(out.stderr))
    for row in rows:
        name = row.pop("check")
        ok = row.pop("ok")
        skipped = row.pop("skipped", None)
        result = "skipped" if skipped else "ok" if ok else "failed"
        detail = skipped or ", ".join(f"{k} {v}" for k, v in row.items())
        report.add(f"day one: {name}", result, detail)


def step_tiny_dpo(r: Runner, report: Report, cpu: bool) -> None:
    """LoRA DPO of the demo on one device: the first loss is ln 2 (the policy is its
    reference, the adapters disabled) and reward accuracy passes 0.8."""
    args = ["run", "tiny-dpo", "--json", "--set", "train.max_steps=10",
            "--set", "train.checkpoint_every=0"]  # fmt: skip
    args += r.devices(cpu) + ([] if cpu else ["--set", "model.dtype=bf16"])
    out = r.cli(*args, cap_s=240)
    events = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    steps = [e for e in events if e.get("type") == "step"]
    if not steps:
        report.add("tiny-dpo (1 process)", f"exit {out.returncode}", last_line(out.stderr))
        return
    first, last = steps[0], steps[-1]
    accuracy = last.get("reward_accuracy") or 0.0
    ok = abs(first["loss"] - math.log(2)) < 1e-3 and accuracy > 0.8
    report.add("tiny-dpo (1 process)", "ok" if ok else "check",
               f"first loss {first['loss']:.6f} (ln 2 = 0.693147), reward accuracy "
               f"{accuracy:.3f}, margin {last.get('reward_margin') or 0.0:.3f}")  # fmt: skip


def step_time_model(r: Runner, report: Report, cpu: bool) -> None:
    """The time model on this device: the demo's predicted tokens/s before and after one
    `measure` (which calibrates the compute rate), against the tokens/s the measure saw."""
    gpus = r.devices(cpu)

    def predicted() -> dict[str, Any]:
        out = r.cli("plan", "tiny-demo", "--json", *gpus, cap_s=60)
        return json.loads(out.stdout)["predicted"] or {}

    before = predicted()
    out = r.cli("measure", "tiny-demo", "--json", "--steps", "6", "--force", *gpus, cap_s=200)
    if out.returncode != 0:
        report.add("time model", f"measure failed (exit {out.returncode})", last_line(out.stderr))
        return
    run_dir = Path(json.loads(out.stdout)["run_dir"])
    lines = (run_dir / "events.jsonl").read_text(encoding="utf-8").splitlines()
    # the steps after the 3 whose memory measure tracks: what `measure` records
    untracked = [e for e in map(json.loads, lines) if e.get("step", 0) > 3]
    measured = median_tokens_per_s(untracked) or 0.0
    after = predicted()
    factor = (after.get("assumptions") or {}).get("achieved_factor") or {}
    ok = measured > 0 and abs(after.get("tokens_per_s", 0.0) / measured - 1) < 0.3
    report.add("time model", "ok" if ok else "off",
               f"default {before.get('tokens_per_s', 0):,.0f} tokens/s, measured {measured:,.0f}, "
               f"calibrated ({factor.get('source')}) {after.get('tokens_per_s', 0):,.0f}")  # fmt: skip


def gpu_name() -> str | None:
    """The first card's name as torch sees it, or None without a usable GPU."""
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


@dataclass
class Found:
    """What one row leaves for the later ones."""

    run_id: str | None = None
    """The tiny-demo run with a result (the eval and serve rows use it)."""
    model: Path | None = None
    """The random Qwen2-0.5B layers (the measure and QLoRA-FSDP rows)."""
    params: int = 0


def step_build(r: Runner, report: Report, found: Found, cpu: bool) -> None:
    """The random Qwen2-0.5B layers the measure rows train (`build_model`)."""
    t = time.monotonic()
    model = r.work / "qwen2-0.5b-random"
    found.params = build_model(model, "cpu" if cpu else "cuda", 2 if cpu else None)
    found.model = model
    report.add("random Qwen2-0.5B layers", "ok", f"{found.params / 1e6:.0f} M parameters "
               f"(vocabulary 2048: the tiny tokenizer's), {time.monotonic() - t:.0f} s")  # fmt: skip


def needs_model(name: str, found: Found, report: Report) -> bool:
    if found.model is None:
        report.add(name, "skipped", "no model: the random Qwen2-0.5B row failed")
        return False
    return True


def row_list(
    r: Runner, report: Report, found: Found, *, cpu: bool, steps: int, peak: float | None
) -> list[tuple[str, Callable[[], Any]]]:
    """Every row in the order it runs: the probe (which card), then the plan against the
    measured (memory per phase, tokens/s, the time model), which the budget must reach, then
    the day-one checks and the user's paths (run, eval, serve, DPO), the doctor last."""

    def measure(method: str) -> Callable[[], Any]:
        def row() -> None:
            if needs_model(f"measure {method}", found, report):
                assert found.model is not None
                step_measure(r, report, method, found.model, found.params, cpu, steps, peak)

        return row

    def qlora_fsdp() -> None:
        if needs_model("QLoRA-FSDP (one card)", found, report):
            assert found.model is not None
            step_qlora_fsdp(r, report, found.model, cpu)

    def demo() -> None:
        found.run_id = step_tiny_demo(r, report, cpu)

    return [
        ("probe", lambda: step_probe(r, report)),
        ("random Qwen2-0.5B layers", lambda: step_build(r, report, found, cpu)),
        ("measure full", measure("full")),
        ("measure lora", measure("lora")),
        ("measure qlora", measure("qlora")),
        ("time model", lambda: step_time_model(r, report, cpu)),
        ("QLoRA-FSDP (one card)", qlora_fsdp),
        ("CUDA day-one checks", lambda: step_day_one(r, report, cpu)),
        ("tiny-demo (1 process)", demo),
        ("eval (tiny-demo run)", lambda: step_eval(r, report, found.run_id, cpu)),
        ("serve (tiny-demo run)", lambda: step_serve(r, report, found.run_id, cpu)),
        ("tiny-dpo (1 process)", lambda: step_tiny_dpo(r, report, cpu)),
        ("doctor", lambda: step_doctor(r, report)),
    ]


def run_rows(rows: list[tuple[str, Callable[[], Any]]], report: Report, r: Runner) -> None:
    """Each row in turn; one that raises is a failed row, and the next runs; once the budget is
    spent, the rest are skipped rows saying so."""
    for name, row in rows:
        if r.left() <= 0:
            report.add(name, "skipped", "out of the time budget")
            continue
        guarded(report, name, row)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="stop starting new rows after this many seconds (default 450)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=8, help="measured steps per method")
    parser.add_argument("--json-out", type=Path, help="also write the figures as JSON here")
    parser.add_argument("--keep", type=Path, help="work in this folder and keep it")
    parser.add_argument("--cpu", action="store_true",
                        help="run the same steps on the CPU, small (tests this script)")  # fmt: skip
    args = parser.parse_args(argv)
    name = gpu_name()
    if name is None and not args.cpu:
        print("no GPU found (torch sees no CUDA device): nothing to validate. The CUDA figures in "
              "README stay modelled; run this on a machine with an NVIDIA GPU.")  # fmt: skip
        return 0
    report = Report(device=name or "the CPU (--cpu: a test of this script, not a GPU figure)")
    with tempfile.TemporaryDirectory(prefix="gpu-validate-") as tmp:
        work = args.keep or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        r = Runner(work, args.budget_s)
        peak = None if args.cpu else peak_bf16_flops(name or "")
        rows = row_list(r, report, Found(), cpu=args.cpu, steps=args.steps, peak=peak)
        run_rows(rows, report, r)
    text = report.markdown()
    print(text)
    if args.json_out:
        args.json_out.write_text(json.dumps({"device": report.device, "rows": report.rows,
                                             "memory": report.memory, "speed": report.speed},
                                            indent=1), encoding="utf-8")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
