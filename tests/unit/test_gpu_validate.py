"""benchmarks/gpu_validate.py: without a GPU it says so and exits 0; it imports neither textual,
bitsandbytes nor datasets at module level; and its arithmetic (MFU, the model config, the
per-phase rows) is right. The GPU rows themselves need a card."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_validate.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules["gpu_validate"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_so_and_exits_0() -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}  # no card, even on a machine with one
    out = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("no GPU found"), out.stdout
    assert "README stay modelled" in out.stdout


def test_it_needs_no_textual_bitsandbytes_or_datasets_to_load() -> None:
    code = (
        "import sys\n"
        "for name in ('textual', 'bitsandbytes', 'datasets'):\n"
        "    sys.modules[name] = None  # importing any of them now raises ImportError\n"
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('v', {str(SCRIPT)!r})\n"
        "m = sys.modules['v'] = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(m)\n"
        "print(m.peak_bf16_flops('NVIDIA H200'))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == pytest.approx(989e12, rel=1e-3)


def test_peak_flops_by_name_and_mfu() -> None:
    v = _load()
    assert v.peak_bf16_flops("NVIDIA H200") == pytest.approx(989e12, rel=1e-3)
    assert v.peak_bf16_flops("NVIDIA H100 PCIe") == pytest.approx(756e12, rel=1e-3)
    assert v.peak_bf16_flops("NVIDIA H100 80GB HBM3") == pytest.approx(989e12, rel=1e-3)
    assert v.peak_bf16_flops("NVIDIA GeForce RTX 4090") == pytest.approx(165e12, rel=2e-3)
    assert v.peak_bf16_flops("Some Future Card") is None
    # 6 · N · tokens/s over the peak: 358 M parameters at 100k tokens/s on an H200
    assert v.mfu(358_000_000, 100_000.0, 989e12) == pytest.approx(6 * 358e6 * 1e5 / 989e12)
    assert v.mfu(358_000_000, 100_000.0, None) is None


def test_the_model_config_takes_the_tokenizers_vocabulary() -> None:
    v = _load()
    base = json.loads(v.CONFIG.read_text(encoding="utf-8"))
    assert base["vocab_size"] == 151936
    cfg = v.model_config(base, 2048, {"bos": 0, "eos": 1, "pad": 2})
    assert cfg["vocab_size"] == 2048
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (0, 1, 2)
    assert cfg["num_hidden_layers"] == base["num_hidden_layers"] == 24
    assert "torch_dtype" not in cfg and cfg["hidden_size"] == 896
    assert v.model_config(base, 2048, {"bos": 0, "eos": None}, layers=2)["num_hidden_layers"] == 2


def test_memory_rows_speed_and_the_table() -> None:
    v = _load()
    g = v.GiB
    doc = {
        "estimate": {"phases": {"load": 2 * g, "forward": 5 * g, "backward": 6 * g}},
        "ranks": [
            {"phases": {"load": {"peak_bytes": 2 * g}, "forward": {"peak_bytes": 4 * g}}},
            {"phases": {"load": {"peak_bytes": 1 * g}, "forward": {"peak_bytes": 5 * g}}},
        ],
    }
    rows = v.memory_rows("full", doc)
    assert rows[0] == ("full", "load", "2.00 GiB", "2.00 GiB", "+0.0%")
    assert rows[1] == ("full", "forward", "5.00 GiB", "5.00 GiB", "+0.0%")  # the largest rank
    assert rows[2] == ("full", "backward", "6.00 GiB", "–", "–")  # not measured
    events = [{"type": "start"}, {"type": "step", "step": 1, "tokens_per_s": 10.0},
              {"type": "step", "step": 2, "tokens_per_s": 100.0},
              {"type": "step", "step": 3, "tokens_per_s": 120.0}]  # fmt: skip
    assert v.median_tokens_per_s(events) == 110.0  # the warm-up step is left out
    assert v.markdown_table(("a", "b"), [("1", "x|y")]).splitlines() == [
        "| a | b |", "|---|---|", "| 1 | x|y |"]  # fmt: skip
    report = v.Report(device="NVIDIA H200")
    report.add("probe", "ok", "1 | card")
    assert "| probe | ok | 1 / card |" in report.markdown()


def test_the_serve_and_eval_helpers() -> None:
    _load()  # puts benchmarks/ on the path, as the script does
    import gpu_validate_steps as s

    from homelab_dp.serving.front.openai_server import ready_line

    # the URL from the very line `homelab-dp serve` prints, after other output
    line = ready_line("20261201-tiny-demo-c75d", "127.0.0.1", 36113, ["GPU 0 (NVIDIA H200)"])
    assert s.serving_url(f"loading...\n{line}\n") == "http://127.0.0.1:36113/v1"
    assert s.serving_url(ready_line("m", "::1", 8000, ["cpu", "cpu"])) == "http://[::1]:8000/v1"
    assert s.serving_url("loading the model\n") is None
    # requests/s and generated tokens/s from the usage objects
    usages = [{"prompt_tokens": 9, "completion_tokens": 5}, {"completion_tokens": 7}]
    assert s.throughput(usages, 0.5) == (4.0, 24.0)
    assert s.throughput([], 0.0) == (0.0, 0.0)
    # the run id: the first event that names it
    events = [{"type": "state", "status": "starting", "run_id": "r1"}, {"type": "start"}]
    assert s.run_id_of(events) == "r1"
    assert s.run_id_of([{"type": "state", "run_id": None}]) is None
    # a process that ended is gone; this one is alive
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    assert s.pids_alive([int(done.stdout), os.getpid()]) == [os.getpid()]


def test_a_step_that_raises_becomes_a_failed_row() -> None:
    _load()
    import gpu_validate_steps as s

    v = sys.modules["gpu_validate"]
    report = v.Report(device="x")

    def broken(n: int) -> int:
        raise ValueError(f"bad {n}")

    assert s.guarded(report, "eval", broken, 3) is None
    assert s.guarded(report, "ok step", lambda n: n + 1, 3) == 4
    assert report.rows == [("eval", "failed", "ValueError: bad 3")]


def test_the_cuda_day_one_checks_run_and_pass_on_the_cpu() -> None:
    """benchmarks/cuda_day_one.py (a row of gpu_validate) runs every check on the CPU too, so
    the first task lent a card finds it working: each check is a JSON line, and each is ok."""
    script = ROOT / "benchmarks" / "cuda_day_one.py"
    out = subprocess.run([sys.executable, str(script), "--device", "cpu", "--json"],
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert [r["check"] for r in rows] == [
        "attention and packing", "inference dtypes", "one bad row fails alone",
        "pinned host memory, activation offload", "device order", "MIG mode", "MoE NF4 experts",
        "packed attention (homelab_packed)", "DPO log-probabilities",
    ]  # fmt: skip
    assert all(r["ok"] for r in rows), rows
    by = {r["check"]: r for r in rows}
    assert by["inference dtypes"]["inv_freq"] == ["torch.float32"]
    assert by["MoE NF4 experts"]["diff"] < 1e-5 and by["MoE NF4 experts"]["quantized_values"] > 0
    assert by["one bad row fails alone"]["finish_reasons"][1:3] == ["error", "error"]
    assert by["packed attention (homelab_packed)"]["route"] == "per-sample"  # varlen: CUDA only
    assert by["DPO log-probabilities"]["first_loss_minus_ln2"] < 1e-6
