"""Wall time of `homelab-dp plan` and `probe` in fresh processes, and of one `probe()` call.

python benchmarks/plan_latency.py [--runs 5]

Prints a markdown table (median, min, max of N runs). The `--model` rows plan config-only
folders written to a temporary folder, each run cold (a fresh process and an empty data home,
so no cached model spec): Qwen3-30B-A3B (a hand-written MoE family, config.json alone) and a
StarCoder2 config (no hand-written spec: the census child builds it on the meta device). The
last row is what
`tests/unit/probe/test_probe.py::test_real_pynvml_without_a_driver_answers_and_says_why` times: the
first `probe()` of a fresh process against the real pynvml (importing pynvml, looking for the
driver, reading the host), `homelab_dp.probe.nvml` already imported; the test bounds it only by
a liveness guard (``PROBE_LIVENESS_S``) many times this figure.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMANDS = {
    "plan tiny-demo --json": ["plan", "tiny-demo", "--json"],
    "plan llama3-8b-qlora-2x24gb --gpus 2x24GiB": [
        "plan",
        "llama3-8b-qlora-2x24gb",
        "--gpus",
        "2x24GiB",
    ],
    "probe --json": ["probe", "--json"],
}
# Qwen3-30B-A3B's config.json (the fields that matter) and a StarCoder2-3B-sized config.
MODEL_FOLDERS = {
    "qwen3_moe (Qwen3-30B-A3B)": {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "max_position_embeddings": 40960,
        "tie_word_embeddings": False, "mlp_only_layers": [], "decoder_sparse_step": 1,
    },
    "starcoder2 (census child)": {
        "architectures": ["Starcoder2ForCausalLM"], "model_type": "starcoder2",
        "vocab_size": 49152, "hidden_size": 3072, "intermediate_size": 12288,
        "num_hidden_layers": 30, "num_attention_heads": 24, "num_key_value_heads": 2,
        "max_position_embeddings": 16384,
    },
}  # fmt: skip
PROBE_CALL = (
    "import time\n"
    "from homelab_dp.probe.nvml import probe\n"
    "started = time.perf_counter()\n"
    "probe()\n"
    "print(time.perf_counter() - started)\n"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    exe = Path(sys.executable).with_name("homelab-dp")
    env = {k: v for k, v in os.environ.items() if k != "HOMELAB_DP_FAKE_NVML"}  # the real pynvml
    rows = []
    for label, argv in COMMANDS.items():
        times = []
        for _ in range(args.runs):
            start = time.perf_counter()
            subprocess.run([str(exe), *argv], cwd=ROOT, env=env, check=True, capture_output=True)
            times.append(time.perf_counter() - start)
        rows.append((f"`homelab-dp {label}` (fresh process)", times))
    with tempfile.TemporaryDirectory() as tmp:
        for label, cfg in MODEL_FOLDERS.items():
            folder = Path(tmp) / label.split()[0]
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(cfg))
            argv = ["plan", "--model", str(folder), "--gpus", "2x24GiB", "--json"]
            times = []
            for run in range(args.runs):
                cold = {**env, "XDG_DATA_HOME": str(Path(tmp) / f"home-{label[:4]}-{run}")}
                start = time.perf_counter()
                subprocess.run(
                    [str(exe), *argv], cwd=ROOT, env=cold, check=True, capture_output=True
                )
                times.append(time.perf_counter() - start)
            rows.append(
                (f"`homelab-dp plan --model` {label}, cold (fresh process, no spec cache)", times)
            )
    calls = []
    for _ in range(args.runs):
        out = subprocess.run([sys.executable, "-c", PROBE_CALL], cwd=ROOT, env=env, check=True,
                             capture_output=True, text=True)  # fmt: skip
        calls.append(float(out.stdout))
    rows.append(("first `probe()` call in a process (real pynvml)", calls))
    load = os.getloadavg()[0]
    print(f"{args.runs} runs each, {os.cpu_count()} CPUs, load average {load:.1f} at the end\n")
    print("| what | median s | min s | max s |")
    print("|---|---:|---:|---:|")
    for label, times in rows:
        print(f"| {label} | {statistics.median(times):.3f} | {min(times):.3f} | {max(times):.3f} |")


if __name__ == "__main__":
    main()
