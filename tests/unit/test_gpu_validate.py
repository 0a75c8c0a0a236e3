"""benchmarks/gpu_validate.py: without a GPU it says so and exits 0; it imports neither textual,
bitsandbytes nor datasets at module level; and its arithmetic (MFU, the model config, the
per-phase rows) is right. The GPU rows themselves need a card."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

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
    assert by["packed attention (homelab_packed)"]["route"] == "sdpa ×2"  # varlen: CUDA only
    assert by["DPO log-probabilities"]["first_loss_minus_ln2"] < 1e-6


# ------------------------------------------------------- the whole row list (issue 32, point 11)


def stand_in_runner(v, work):  # noqa: ANN001, ANN201
    """A `Runner` whose CLI and helper scripts answer as on a bare H200 (the process boundary
    of the script): each answer has the shape the real command prints; every call recorded."""

    class StandIn(StandInAnswers, v.Runner):
        def __init__(self) -> None:
            super().__init__(work, 300.0)
            self.calls: list[tuple[str, ...]] = []

    return StandIn()


class StandInAnswers:
    """What a bare H200 machine's commands print, by command."""

    work: Path
    calls: list[tuple[str, ...]]

    def answer(self, args: tuple[str, ...]) -> tuple[int, str]:
        g = 1024**3
        if args[0] == "probe":
            return 0, json.dumps(
                {
                    "gpus": [{"index": 3, "name": "NVIDIA H200", "memory_total": 141 * g}],
                    "driver_version": "580",
                }
            )
        if args[0] == "doctor":
            return 0, json.dumps(
                {
                    "checks": [
                        {"name": "torch", "status": "ok"},
                        {"name": "textual", "status": "warn", "detail": "not installed"},
                    ]
                }
            )
        if args[0] == "plan":
            return 0, json.dumps(
                {
                    "predicted": {
                        "tokens_per_s": 90_000.0,
                        "assumptions": {"achieved_factor": {"source": "measured"}},
                    }
                }
            )
        if args[0] == "measure":
            run_dir = self.work / f"m{len(self.calls)}"
            run_dir.mkdir()
            steps = [
                {"type": "step", "step": s, "tokens_per_s": 100_000.0 + s} for s in range(1, 9)
            ]
            (run_dir / "events.jsonl").write_text(
                "".join(
                    json.dumps(e) + "\n" for e in [{"type": "start", "params": 358_000_000}, *steps]
                ),
                encoding="utf-8",
            )
            phases = {p: 2 * g for p in ("load", "forward", "backward", "optimizer")}
            return 0, json.dumps(
                {
                    "run_dir": str(run_dir),
                    "kind": "full",
                    "estimate": {"phases": phases, "tensor_bytes": 2 * g},
                    "ranks": [{"phases": {p: {"peak_bytes": g} for p in phases}}],
                    "measured_peak_bytes": g,
                    "error": 1.0,
                }
            )
        if args[0] == "run" and args[1] == "tiny-demo":
            events = [
                {"type": "state", "status": "starting", "run_id": "r1"},
                {"type": "start", "device": "cuda", "dtype": "bf16", "world_size": 1},
                {
                    "type": "end",
                    "steps": 30,
                    "final_loss": 2.5,
                    "seconds": 9.0,
                    "final_path": "/x/final",
                },
                {"type": "state", "status": "completed", "run_id": "r1"},
            ]
            return 0, "".join(json.dumps(e) + "\n" for e in events)
        if args[0] == "run" and args[1] == "tiny-dpo":
            events = [
                {"type": "step", "loss": 0.693147, "reward_accuracy": 0.5},
                {"type": "step", "loss": 0.3, "reward_accuracy": 0.9, "reward_margin": 1.0},
            ]
            return 0, "".join(json.dumps(e) + "\n" for e in events)
        if args[0] == "eval":
            return 0, json.dumps(
                {
                    "device": "cuda",
                    "dtype": "bf16",
                    "world_size": 1,
                    "loss": 2.0,
                    "perplexity": 7.4,
                    "tokens_per_s": 5e4,
                    "real_tokens": 1000,
                    "samples": 10,
                    "seconds": 0.1,
                }
            )
        if args[0] == "cuda_day_one.py":
            rows = [
                {"check": "attention and packing", "ok": True},
                {"check": "MoE NF4 experts", "ok": True, "skipped": "bitsandbytes not installed"},
            ]
            return 0, "".join(json.dumps(r) + "\n" for r in rows)
        raise AssertionError(f"no stand-in answer for {args}")

    def cli(self, *args: str, cap_s: float = 180):  # noqa: ANN201
        self.calls.append(args)
        code, out = self.answer(args)
        return subprocess.CompletedProcess(args, code, out, "")

    def script(self, name: str, *args: str, cap_s: float):  # noqa: ANN201
        return self.cli(name, *args)


ABSENT = ("bitsandbytes", "tensorboard", "textual", "datasets", "tomli_w")
"""What a bare card's image lacks (issue 32): torch and transformers only, and carried wheels."""


def test_the_whole_row_list_runs_on_the_cpu_with_stand_ins(tmp_path, monkeypatch) -> None:
    """Every row of the script, in its order, against a bare H200's answers: torch and
    transformers only (no bitsandbytes: its rows skip and say why), CUDA_VISIBLE_DEVICES=3
    (every row names NVML card 3), the plan-against-measured rows first, no row raising."""
    import importlib.util as iu

    v = _load()
    real = iu.find_spec
    monkeypatch.setattr(iu, "find_spec",
                        lambda n, *a: None if n in ABSENT else real(n, *a))  # fmt: skip
    r = stand_in_runner(v, tmp_path)
    report, found = v.Report(device="NVIDIA H200 (stand-in)"), v.Found()
    rows = v.row_list(r, report, found, cpu=False, steps=8, peak=989e12)
    names = [n for n, _ in rows]
    assert names.index("measure full") < names.index("tiny-demo (1 process)")
    assert names.index("time model") < names.index("CUDA day-one checks")
    # The real model build, on the CPU here (the row builds on the card there).
    rows = [(n, (lambda: v.step_build(r, report, found, True)) if n.startswith("random") else f)
            for n, f in rows]  # fmt: skip
    v.run_rows(rows, report, r)
    got = {name: (result, detail) for name, result, detail in report.rows}
    assert r.card == 3
    assert all("hardware.devices=[0]" not in a for call in r.calls for a in call)
    assert any("hardware.devices=[3]" in call for call in r.calls)
    runs = [c for c in r.calls if c[0] in ("run", "plan", "measure") and "tiny-demo" in c]
    assert runs and all("log.report_to=[]" in c for c in runs)  # no tensorboard there
    assert got["measure qlora"] == ("skipped", "bitsandbytes not installed")
    assert got["QLoRA-FSDP (one card)"] == ("skipped", "bitsandbytes not installed")
    assert got["day one: MoE NF4 experts"][0] == "skipped"
    failed = {n: d for n, (res, d) in got.items() if "failed" in res}
    assert set(failed) <= {"serve (tiny-demo run)"}, failed  # a real serve of a stand-in run
    assert got["measure full"][0] == got["measure lora"][0] == "ok"
    assert got["eval (tiny-demo run)"][0] == "ok" and got["tiny-dpo (1 process)"][0] == "ok"
    assert [m[0] for m in report.memory] == ["full"] * 4 + ["lora"] * 4
    assert "| measure full | ok |" in report.markdown()
    order = [name for name, _, _ in report.rows]
    assert order.index("measure full") < order.index("tiny-demo (1 process)")


def test_the_pinned_row_reads_while_its_optimizer_is_alive(monkeypatch) -> None:
    """HostAdamW's pinned buffers go back to the host allocator when it is freed: the row reads
    the card's counter (here a stand-in: what every live HostAdamW pins, as the plan says)
    before that, so measured equals planned."""
    import weakref

    from homelab_dp.planning.memory.pinned_memory import host_adamw_pinned_bytes
    from homelab_dp.train.parallelism import host_optimizer

    live: weakref.WeakSet = weakref.WeakSet()

    class Tracked(host_optimizer.HostAdamW):
        def __init__(self, *a, **kw) -> None:  # noqa: ANN002, ANN003
            super().__init__(*a, **kw)
            live.add(self)

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import cuda_day_one
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))

    def live_pinned() -> int:
        return sum(
            host_adamw_pinned_bytes(4 * sum(p.numel() for g in o.param_groups for p in g["params"]))
            for o in list(live)
        )

    monkeypatch.setattr(host_optimizer, "HostAdamW", Tracked)
    row = cuda_day_one.check_pinned_and_offload("cpu", read_pinned=live_pinned)
    assert row["host_adamw_pinned"] == row["host_adamw_planned"] > 0
    assert row["ok"]


BARE_H200 = {"torch": "2.11.0", "transformers": "5.17.0"}
"""What the first card this project meets has installed (issue 32): and no textual,
bitsandbytes, datasets or tomli-w."""


def _floor(requirement: str) -> tuple[int, ...]:
    return tuple(
        int(x) for x in requirement.split(">=", 1)[1].split(";")[0].split(",")[0].split(".")
    )


def test_the_declared_floors_admit_the_bare_h200() -> None:
    """pyproject.toml's minimum torch and transformers are at or below the bare card's."""
    import tomllib

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {d.split(">=")[0].strip(): _floor(d) for d in deps if ">=" in d}
    for name, version in BARE_H200.items():
        have = tuple(int(x) for x in version.split("."))
        assert floors[name] <= have, (name, floors[name], version)


def test_the_package_plans_and_loads_its_gpu_paths_without_the_absent_packages(tmp_path) -> None:
    """With textual, bitsandbytes, datasets and tomli-w unimportable, the CLI plans, and the
    modules the validation's rows run (worker, eval, serve, measure) import."""
    code = (
        "import sys\n"
        "for name in ('textual', 'bitsandbytes', 'datasets', 'tomli_w'):\n"
        "    sys.modules[name] = None  # importing any of them now raises ImportError\n"
        "import importlib\n"
        "for m in ('homelab_dp.train.loop.worker', 'homelab_dp.train.evaluation.eval_worker', 'homelab_dp.app.serve',\n"
        "          'homelab_dp.app.measure', 'homelab_dp.app.evaluate', 'homelab_dp.app.runs',\n"
        "          'homelab_dp.serving.replica.transformers_replica'):\n"
        "    importlib.import_module(m)\n"
        "from homelab_dp.cli.main import main\n"
        "sys.exit(main(['plan', 'tiny-demo', '--gpus', '2x141GiB@9.0', '--json']))\n"
    )
    env = {**os.environ, "HOMELAB_DP_RUNS": str(tmp_path / "runs"),
           "XDG_CONFIG_HOME": str(tmp_path / "c"), "XDG_DATA_HOME": str(tmp_path / "d")}  # fmt: skip
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout)["fits"] is True
