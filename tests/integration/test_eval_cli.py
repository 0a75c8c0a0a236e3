"""`homelab-dp eval` through the real CLI: real torchrun workers on the CPU, nothing mocked.

- The loss is the same on 1 and 2 processes and equals a direct transformers computation in
  this process (one forward per sample, cross-entropy summed over the targets / their count).
- An adapter folder evaluates as its base with the adapter applied, computed directly.
- Bad input is refused before anything is spawned; Ctrl-C leaves no process behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from homelab_dp.app.evaluate import EvalReport, parse_gpus, select_devices
from homelab_dp.cli import main
from homelab_dp.probe.hardware import HardwareReport, HostInfo

from ..conftest import DATA, ROOT, default_sigint
from .conftest import DEMO_DATA, make_run

pytestmark = pytest.mark.slow
SEQ_LEN = 32  # some instruction rows are longer: truncation is part of what is compared
FIELDS = {"model", "data", "world_size", "loss", "perplexity", "tokens", "real_tokens",
          "tokens_per_s", "seconds", "seq_len", "base"}  # fmt: skip


def _start(*args: str) -> subprocess.Popen[str]:
    """`homelab-dp eval … --json` in a subprocess."""
    cmd = [sys.executable, "-m", "homelab_dp.cli", "eval", *args, "--json"]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
    )


def _document(proc: subprocess.Popen[str], timeout: float = 240) -> dict[str, Any]:
    """The JSON document of a finished `_start` (its stderr when it failed)."""
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out)


def direct_loss(
    model_dir: Path, data: Path, seq_len: int, adapter: Path | None = None
) -> tuple[float, int]:
    """(mean token NLL, target tokens): each sample alone, truncated to ``seq_len`` inputs."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from homelab_dp.data.blocks import tokenize_records
    from homelab_dp.data.samples import read_with_lines

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    records, _, fmt = read_with_lines(data, "auto")
    examples = tokenize_records(records, fmt, tokenizer)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for ex in examples:
            ids = torch.tensor([ex.input_ids[:seq_len]])
            targets = torch.tensor(ex.labels[1 : seq_len + 1])
            logits = model(input_ids=ids).logits[0, : len(targets)]
            total += float(
                F.cross_entropy(logits.double(), targets, ignore_index=-100, reduction="sum")
            )
            count += int((targets != -100).sum())
    return total / count, count


@pytest.fixture(scope="module")
def text_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """16 texts of 13 to 116 tokens: with --seq-len 96 some are truncated, and the samples go
    through the model in two length groups (64 and 96 tokens)."""
    rows = [json.loads(line) for line in DEMO_DATA.read_text(encoding="utf-8").splitlines()[:40]]
    texts = [" ".join(f"{r['instruction']} {r['output']}" for r in rows[i : i + 1 + i % 7])
             for i in range(16)]  # fmt: skip
    path = tmp_path_factory.mktemp("eval-data") / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    return path


def test_one_and_two_processes_agree_with_a_direct_computation(tiny_model, text_data) -> None:
    """The model folder on 1 process; the same weights as a run's result on 2, named by a
    prefix of the run id, with the run's seq_len as the default."""
    data = text_data
    run_dir = make_run(Path(os.environ["HOMELAB_DP_RUNS"]), tiny_model, data,
                       name="20260101-000000-evaltest-abcd", seq_len=96)  # fmt: skip
    shutil.copytree(tiny_model, run_dir / "final")
    # Side by side: most of each is starting processes and importing torch.
    procs = (_start(str(tiny_model), "--data", str(data), "--gpus", "cpu:1", "--seq-len", "96"),
             _start("20260101-000000-eval", "--data", str(data), "--gpus", "cpu:2"))  # fmt: skip
    loss, count = direct_loss(tiny_model, data, 96)
    one, two = (_document(p) for p in procs)
    assert one.keys() >= FIELDS and two.keys() >= FIELDS
    assert (one["world_size"], two["world_size"]) == (1, 2)
    assert one["model"] == tiny_model.name and two["model"] == run_dir.name
    assert one["data"] == str(data)
    assert one["seq_len"] == two["seq_len"] == 96 and one["device"] == "cpu"
    assert one["base"] == two["base"] == "fp32"  # a full model on the CPU
    assert one["tokens"] == two["tokens"] and one["real_tokens"] == two["real_tokens"]
    assert one["samples"] == 16
    assert math.isclose(one["loss"], two["loss"], rel_tol=1e-6)
    assert one["tokens"] == count
    assert math.isclose(one["loss"], loss, rel_tol=1e-5), (one["loss"], loss)
    assert math.isclose(one["perplexity"], math.exp(one["loss"]), rel_tol=1e-9)
    assert one["real_tokens"] > one["tokens"] > 0 and one["tokens_per_s"] > 0


def test_an_adapter_folder_is_its_base_with_the_adapter(tiny_model, data_dir, tmp_path) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(3)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    config = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )  # random B: the adapter changes the loss
    adapter = tmp_path / "adapter"
    get_peft_model(base, config).save_pretrained(adapter)
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    data = data_dir / "ragged-12.jsonl"
    proc = _start(str(adapter), "--data", str(data), "--gpus", "cpu:2", "--seq-len", str(SEQ_LEN))
    loss, count = direct_loss(tiny_model, data, SEQ_LEN, adapter)
    base_loss, _ = direct_loss(tiny_model, data, SEQ_LEN)
    got = _document(proc)
    assert got["model"] == "adapter" and got["world_size"] == 2
    assert got["tokens"] == count and abs(loss - base_loss) > 1e-3
    assert math.isclose(got["loss"], loss, rel_tol=1e-5), (got["loss"], loss, base_loss)


def _eval_dirs(tmp: Path) -> set[str]:
    """The eval folders in ``tmp``: each test gives its evals a temporary folder of their own
    (a test in the other pytest worker may be making eval folders in the system's meanwhile)."""
    return {p.name for p in tmp.glob("homelab-dp-eval-*")}


BAD = DATA / "bad_input" / "models"
CASES = {
    "missing data file": (["{model}", "--data", "/no/such/data.jsonl"],
                          "--data: /no/such/data.jsonl does not exist"),
    "unknown model": (["no-such-model", "--data", "{data}"],
                      "model 'no-such-model': no such folder, and no run with that id"),
    "a what-if --gpus": (["{model}", "--data", "{data}", "--gpus", "2x24GiB"],
                         "--gpus: '2x24GiB' is not a device selection for eval"),
    "more CPU processes than cores": (["{model}", "--data", "{data}", "--gpus", "cpu:4096"],
                                      "--gpus: 4096 CPU processes, this machine has"),
    "--seq-len beyond the positions": (["{model}", "--data", "{data}", "--seq-len", "4096"],
                                       "--seq-len: 4096 is beyond the model's 128 positions"),
    "a bad JSON line": (["{model}", "--data", str(DATA / "bad_data" / "bad-json-line.jsonl")],
                        "bad-json-line.jsonl:3: not valid JSON"),
    "an unknown format": (["{model}", "--data", "{data}", "--format", "csv"],
                          "--format: unknown format 'csv'"),
    "pickle weights": ([str(BAD / "pickle-weights"), "--data", "{data}"],
                       "only pickle weights (pytorch_model.bin); refused, never loaded"),
    "remote code": ([str(BAD / "remote-code"), "--data", "{data}"],
                    "the model needs its own Python code (auto_map)"),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(CASES))
def test_bad_input_is_refused_before_anything_starts(
    kind, tiny_model, data_dir, capsys, tmp_path, monkeypatch
) -> None:
    marker = tmp_path / "code-ran"
    monkeypatch.setenv("HOMELAB_DP_TEST_MARKER", str(marker))
    argv, needle = CASES[kind]
    argv = [a.format(model=tiny_model, data=data_dir / "ragged-12.jsonl") for a in argv]
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    private = tmp_path / "tmp"
    private.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private))  # where eval would make its folder
    rc = main(["eval", *argv])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert rc == 2 and out.out == "", out
    assert lines[0].startswith("error: ") and needle in lines[0], lines
    assert lines[-1].startswith("hint: ") and len(lines) == 2
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children, "spawned"
    assert _eval_dirs(private) == set() and not marker.exists()


def test_data_of_every_kind_training_reads(tiny_model, data_dir, tmp_path, monkeypatch) -> None:
    """--data takes what data.path takes (here Parquet) through the same reader and token
    cache: the same samples as the JSON lines, and the workers' blocks come from the cache the
    front end filled (no second tokenization)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    from homelab_dp.app.evaluate import job_document, prepare
    from homelab_dp.data import token_cache
    from homelab_dp.train.evaluation.eval_worker import load_blocks

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    jsonl = data_dir / "ragged-12.jsonl"
    parquet = tmp_path / "ragged.parquet"
    pq.write_table(pa.Table.from_pylist([json.loads(x) for x in jsonl.open()]), parquet)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    blocks = []
    for data in (jsonl, parquet):
        job = prepare(str(tiny_model), str(data), seq_len=64, gpus="cpu:1")
        blocks.append(load_blocks(job_document(job, tmp_path), tokenizer))
        assert job.samples == len(blocks[-1]) > 0
    assert blocks[0] == blocks[1]
    uses = sorted(u["use"] for e in token_cache.cache_root().iterdir() for u in token_cache.uses(e))
    assert uses == [
        "built",
        "built",
        "hit",
        "hit",
    ]  # each file: the front end built, the worker hit


def test_gpus_selection_without_probing_cuda() -> None:
    """cpu:N and GPU indices are read without a probe; no --gpus on a machine without GPUs is
    one CPU process (the NVML report of such a machine)."""
    assert parse_gpus("cpu") == ("cpu", 1, ()) and parse_gpus("CPU:2") == ("cpu", 2, ())
    assert parse_gpus("0, 2") == ("cuda", 2, (0, 2)) and parse_gpus(None) == ("auto", 0, ())
    for bad in ("2x24GiB", "cpu:2:64GiB", "0,0", "cpu:0", "gpu0"):
        with pytest.raises(Exception, match="--gpus"):
            parse_gpus(bad)
    no_gpu = HardwareReport("cpu", HostInfo("test cpu", 2, 2, 8 << 30), notice="no NVIDIA driver")
    assert select_devices(None, no_gpu).kind == "cpu" and select_devices(None, no_gpu).nproc == 1
    with pytest.raises(Exception, match="no visible GPU with index 1") as err:
        select_devices("1", no_gpu)
    assert "no NVIDIA driver" in err.value.hint


def test_the_table_shows_every_figure() -> None:
    from rich.console import Console

    from homelab_dp.render.evaluate import render_eval

    report = EvalReport(model="run-1", data="/d.jsonl", world_size=2, loss=1.25, perplexity=3.4903,
                        tokens=1200, real_tokens=3000, tokens_per_s=1500.0, seconds=2.0,
                        seq_len=256, samples=40, device="cpu", dtype="fp32", base="nf4")  # fmt: skip
    console = Console(width=120, record=True)
    console.print(render_eval(report))
    text = console.export_text()
    for needle in ("run-1", "/d.jsonl (40 samples, seq_len 256)", "2 CPU processes · fp32",
                   "1.2500 nats", "3.490", "1,200", "1,500", "2.00", "NF4"):  # fmt: skip
        assert needle in text, text


def test_ctrl_c_stops_the_workers_and_leaves_nothing(tiny_model, data_dir, tmp_path) -> None:
    """SIGINT to the CLI (what Ctrl-C sends it; torchrun runs in its own session): exit 130,
    every torchrun and worker process gone, the private folder removed."""
    private = tmp_path / "tmp"
    private.mkdir()
    cmd = [sys.executable, "-m", "homelab_dp.cli", "eval", str(tiny_model), "--data",
           str(data_dir / "ragged-12.jsonl"), "--gpus", "cpu:2"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT,
                            env={**os.environ, "TMPDIR": str(private)},
                            preexec_fn=default_sigint)  # fmt: skip
    cli = psutil.Process(proc.pid)
    family: list[psutil.Process] = []
    deadline = time.monotonic() + 120  # liveness guard: workers start in about 10 s
    while time.monotonic() < deadline and proc.poll() is None:
        family = cli.children(recursive=True)
        # The workers, not torchrun (whose command line names the worker module too).
        lines = [" ".join(_cmdline(p)) for p in family]
        workers = [
            c
            for c in lines
            if "homelab_dp.train.evaluation.eval_worker" in c
            and "homelab_dp.supervise.torchrun_agent" not in c
        ]
        if len(workers) == 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None and len(family) >= 3, "the workers never started"
    assert len(_eval_dirs(private)) == 1  # its folder, made where TMPDIR says
    os.kill(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    gone, alive = psutil.wait_procs(family, timeout=10)
    assert not alive, [(_cmdline(p), p.status()) for p in alive]
    assert _eval_dirs(private) == set()


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def test_length_groups_cut_only_padding() -> None:
    """Each sample keeps its tokens, mask, positions and targets; groups are 64-token multiples
    (never past the block), longest first."""
    from homelab_dp.data.blocks import Example, build_blocks
    from homelab_dp.train.evaluation.eval_worker import length_groups

    examples = [Example(list(range(n)), [-100, *range(1, n)]) for n in (5, 70, 130, 200, 300)]
    blocks = build_blocks(examples, 256, False, 0)
    groups = length_groups(blocks)
    assert [len(g[0].input_ids) for g in groups] == [256, 192, 128, 64]
    cut = [b for g in groups for b in g]
    assert sorted(b.num_targets for b in cut) == sorted(b.num_targets for b in blocks)
    for b in cut:
        real = sum(b.attention_mask)
        whole = next(x for x in blocks if x.input_ids[:real] == b.input_ids[:real])
        assert b.labels == whole.labels[: len(b.labels)] and b.position_ids == list(
            range(len(b.input_ids))
        )
