"""The 2026 layer kinds train for real under the launcher: Gated DeltaNet, Mamba-2, MoE.

Tiny random models (tests.tiny_hybrids) of qwen3_5_text (LoRA: Gated DeltaNet's projections
adapted), nemotron_h (LoRA: Mamba-2's in_proj adapted, its out_proj left alone as peft
requires, the MoE router frozen) and ernie4_5_moe (full fine-tuning: a dense first layer, then
MoE) each train once on 2 processes and once on 1 (the same spec: accumulation 2 keeps the
batch), in fp64 on the torch reference kernels. One module-scoped set of runs serves every
claim: the loss falls; 1 and 2 processes agree to fp64 rounding (the same micro-batches: the
step's samples grouped by length, unpacked, as the plan trains these models); a run stopped
after step 2 and resumed ends on the uninterrupted run's weights; `eval` of the Qwen3.5 result
equals `eval` of its merged export. Tiny falcon_h1, qwen3_5_moe_text, lfm2 and gemma4_text go
through `homelab-dp run` itself: the plan turns packing off for the recurrent ones and says why
(and keeps it, checked, for Gemma 4), and LoRA launches (past what peft refuses on Mamba).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from homelab_dp.runs.folder.run_folder import read_run_spec
from tests.conftest import run_cli
from tests.integration.conftest import (
    copy_run,
    events,
    final_weights,
    make_run,
    max_abs_diff,
    run,
    run_detached,
)

pytestmark = pytest.mark.slow
TOL = 1e-12  # test_equivalence's: fp64 summation order
FAMILIES = {"qwen3_5_text": "lora", "nemotron_h": "lora", "ernie4_5_moe": "full"}
RESUMED = ("qwen3_5_text", "nemotron_h")
"""The recurrent families also stopped after step 2 and resumed."""
STEPS = 4


class Runs:
    """Each family's runs, made when a test first asks for them (module-scoped)."""

    def __init__(self, root: Path, data: Path, models: Callable[[str], Path]) -> None:
        self.root, self.data, self.models = root, data, models
        self.made: dict[str, dict[str, Path]] = {}

    def __getitem__(self, family: str) -> dict[str, Path]:
        if family not in self.made:
            method, out = FAMILIES[family], {}
            for nproc in (2, 1):
                rd = make_run(self.root, self.models(family), self.data, name=f"{family}-{nproc}",
                              method=method, world=2, micro=2, dtype="fp64",
                              lr=1e-2 if method == "full" else 3e-2,
                              train={"max_steps": STEPS})  # fmt: skip
                assert run(rd, nproc) == 0
                out[str(nproc)] = rd
            if family in RESUMED:
                rd = make_run(self.root, self.models(family), self.data, name=f"{family}-stop",
                              method=method, world=2, micro=2, dtype="fp64", lr=3e-2,
                              train={"max_steps": STEPS})  # fmt: skip
                assert run(rd, 2, stop_at=2) == 0
                out["stopped"] = copy_run(rd, self.root, f"{family}-stopped-copy")
                assert run(rd, 2, resume=True) == 0
                out["resumed"] = rd
            self.made[family] = out
        return self.made[family]


@pytest.fixture(scope="module")
def runs(
    data_dir: Path, tmp_path_factory: pytest.TempPathFactory, tiny_hybrid: Callable[[str], Path]
) -> Runs:
    """The families' runs on four samples of different lengths (one effective batch, so the
    last step's loss is comparable with the first's)."""
    root = tmp_path_factory.mktemp("hybrid")
    lines = (data_dir / "ragged-12.jsonl").read_text(encoding="utf-8").splitlines()[:4]
    (root / "four.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return Runs(root, root / "four.jsonl", tiny_hybrid)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trains_and_two_ranks_match_one(family: str, runs: Runs) -> None:
    two, one = runs[family]["2"], runs[family]["1"]
    steps = events(two, "step")
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.05, [e["loss"] for e in steps]
    assert events(two, "end")[-1]["reason"] == "completed"
    losses_one = [e["loss"] for e in events(one, "step")]
    assert max(abs(a["loss"] - b) for a, b in zip(steps, losses_one, strict=True)) < 1e-9
    assert max_abs_diff(final_weights(two), final_weights(one)) < TOL
    names = list(final_weights(two))
    if FAMILIES[family] == "lora":
        assert all("lora_" in n for n in names)
        assert not any(".gate." in n or ".router." in n for n in names), names  # router frozen
        assert not any("mixer.out_proj" in n or "conv1d" in n for n in names), names
        recurrent = {"qwen3_5_text": "linear_attn.in_proj_qkv", "nemotron_h": "mixer.in_proj"}
        assert any(recurrent[family] in n for n in names), names


@pytest.mark.parametrize("family", RESUMED)
def test_a_stop_and_resume_is_exact(family: str, runs: Runs) -> None:
    made = runs[family]
    stopped = events(made["stopped"], "end")[-1]
    assert stopped["reason"] == "stopped" and stopped["steps"] == 2
    resumed = events(made["resumed"], "step")
    assert resumed[-1]["step"] == STEPS
    assert max_abs_diff(final_weights(made["resumed"]), final_weights(made["2"])) < TOL


def test_the_result_evaluates_as_its_export(
    runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    two = runs["qwen3_5_text"]["2"]

    def loss(model: Path) -> float:
        rc, out, err = run_cli(capsys, "eval", str(model), "--data", str(runs.data),
                               "--gpus", "cpu:1", "--seq-len", "32", "--json")  # fmt: skip
        assert rc == 0, err
        return float(json.loads(out)["loss"])

    merged = tmp_path / "merged"
    rc, _, err = run_cli(capsys, "export", str(two), "--format", "merged", "--out", str(merged),
                         "--json")  # fmt: skip
    assert rc == 0, err
    trained, exported = loss(two), loss(merged)
    base = loss(runs.models("qwen3_5_text"))
    assert abs(trained - exported) < 1e-6 * trained
    assert trained < base - 0.05, (trained, base)


CLI_FAMILIES = {
    # model_type: (packed as asked?, the plan's recurrent kind, a module LoRA adapts, one it must not)
    "falcon_h1": (False, "mamba2", "mamba.in_proj", "out_proj"),
    "qwen3_5_moe_text": (False, "linear_attention", "linear_attn.in_proj_qkv", "experts"),
    "lfm2": (False, "short_conv", "conv.in_proj", "conv.conv"),
    "gemma4_text": (True, "", "self_attn.q_proj", "router"),
}


@pytest.mark.parametrize("family", list(CLI_FAMILIES))
def test_a_family_runs_from_the_cli_with_lora(
    family: str, runs: Runs, tiny_hybrid: Callable[[str], Path]
) -> None:
    """`homelab-dp run` of the demo preset (which packs) on the tiny model: the plan turns
    packing off for a recurrent family and says why, keeps it (checked on the real model) for an
    attention-only one, and LoRA launches and trains (peft used to refuse falcon_h1's Mamba
    out_proj at launch)."""
    packed, kind, adapted, never = CLI_FAMILIES[family]
    rd = run_detached("tiny-demo", "--gpus", "cpu:1", "--set", f"model.path={tiny_hybrid(family)}",
                      "--set", f"data.path={runs.data}", "--set", "data.seq_len=32",
                      "--set", "train.method=lora", "--set", "train.max_steps=2",
                      "--set", "train.micro_batch=2", "--set", "train.grad_accum=1",
                      guard_s=600)  # fmt: skip
    spec = read_run_spec(rd)
    assert spec.preset.data.pack is packed and spec.resolved.method == "lora"
    reasons = spec.plan["reasons"]
    off = [r for r in reasons if r.startswith("Packing off")]
    assert (off and kind in off[0]) if not packed else not off, reasons
    assert events(rd, "start")[-1]["packing"] == ("exact" if packed else "off")
    steps = events(rd, "step")
    assert [e["step"] for e in steps] == [1, 2]
    names = list(final_weights(rd))
    assert any(adapted in n for n in names) and not any(f".{never}." in n for n in names), names


def test_qlora_of_a_mamba_hybrid_keeps_out_proj_16_bit_under_fsdp(
    runs: Runs, tiny_hybrid: Callable[[str], Path]
) -> None:
    """QLoRA streamed under FSDP2 on 2 processes: every linear NF4 but lm_head and Mamba's
    out_proj (mamba-ssm's fused kernel reads its weight), as the worker logs."""
    rd = run_detached("tiny-demo", "--gpus", "cpu:2", "--set", f"model.path={tiny_hybrid('falcon_h1')}",
                      "--set", f"data.path={runs.data}", "--set", "data.seq_len=32",
                      "--set", "train.method=qlora", "--set", "train.distribution=fsdp-full",
                      "--set", "train.max_steps=2", "--set", "train.micro_batch=1",
                      "--set", "train.grad_accum=2", guard_s=600)  # fmt: skip
    assert [e["step"] for e in events(rd, "step")] == [1, 2]
    log = "\n".join(p.read_text(encoding="utf-8") for p in (rd / "logs").glob("*.log"))
    assert "QLoRA: 16 linears in NF4, 3 kept 16-bit (lm_head, out_proj ×2)" in log
    assert not any("out_proj" in n for n in final_weights(rd))
