"""The 2026 layer kinds train for real under the launcher (issue 36): every family of
`tests.tiny_hybrids` — qwen3_5_text, qwen3_5_moe_text (Gated DeltaNet, gated attention, MoE),
nemotron_h, falcon_h1 (Mamba-2), lfm2 (short convolutions), ernie4_5_moe (a dense first layer,
then MoE) and gemma4_text (sliding attention, its MoE block, per-layer inputs).

Each family trains twice in fp64 on the torch reference kernels, from the same run spec (world 2,
micro-batch 2: one process accumulates 2 to keep the batch): once uninterrupted on 1 process,
and once on 2 processes stopped after step 2 and resumed. Equal weights (to fp64 rounding) and
equal losses prove both claims at once: 1 and 2 processes agree (the same micro-batches: the
step's samples grouped by length, unpacked, as the plan trains these models), and a stop and
resume is exact. The loss falls; LoRA adapts the families' own projections (Gated DeltaNet's,
Mamba-2's in_proj, the short convolution's) and never what peft refuses or what must stay
frozen (Mamba's out_proj, convolutions, routers, routed experts); ernie4_5_moe is a full
fine-tune. The runs evaluate their result at the last step (1 and 2 processes agree); `eval`
of the merged export says the same, and the result beats the base model.

`homelab-dp measure` of each family (one process, 2 steps, the family's method) is within 10%
of the plan, per phase too; the same launch is the CLI path's check of the plan: a preset that
packs gets packing turned off, with the reason, for the families with recurrent layers, and
kept (checked on the real model) for ERNIE 4.5 and Gemma 4. A QLoRA launch of falcon_h1 under
FSDP2 keeps Mamba's out_proj 16-bit.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from homelab_dp.cli import main
from homelab_dp.runs.folder.run_folder import read_run_spec
from tests.conftest import run_cli, write_preset
from tests.integration.conftest import (
    events,
    final_weights,
    make_run,
    max_abs_diff,
    run,
    run_detached,
    run_together,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("results")]  # tests/conftest.py
TOL = 1e-12  # test_equivalence's: fp64 summation order
BOUND = 0.10  # measure against the plan
STEPS = 4
STOP = 2
SEQ = 64
"""Every sample whole: qwen3_5_moe_text's tokenizer (the demo's vocabulary, loaded as
Qwen3.5's) cuts digits apart, and at 32 tokens one sample kept no target, so 2 processes of
micro-batch 2 had 3 sequences for 4 places."""
FAMILIES = {
    # model_type: (method, a module LoRA adapts, modules it must leave alone)
    "qwen3_5_text": ("lora", "linear_attn.in_proj_qkv", ("conv1d",)),
    "qwen3_5_moe_text": ("lora", "linear_attn.in_proj_qkv", ("experts", "conv1d")),
    "nemotron_h": ("lora", "mixer.in_proj", ("gate", "mixer.out_proj", "conv1d", "experts")),
    "falcon_h1": ("lora", "mamba.in_proj", ("out_proj", "conv1d")),
    "lfm2": ("lora", "conv.in_proj", ("conv.conv",)),
    "ernie4_5_moe": ("full", "", ()),
    "gemma4_text": ("lora", "self_attn.q_proj", ("router", "experts")),
}
RECURRENT = {"qwen3_5_text": "linear_attention", "qwen3_5_moe_text": "linear_attention",
             "nemotron_h": "mamba2", "falcon_h1": "mamba2", "lfm2": "short_conv"}  # fmt: skip
"""The families with layers that carry a state: the plan turns packing off and names their
kind; it keeps packing for the others (ernie4_5_moe, gemma4_text), checked by the worker."""


class Runs:
    """Each family's two runs, made when a test first asks for them (module-scoped)."""

    def __init__(self, root: Path, data: Path, models: Callable[[str], Path]) -> None:
        self.root, self.data, self.models = root, data, models
        self.made: dict[str, dict[str, Path]] = {}

    def __getitem__(self, family: str) -> dict[str, Path]:
        if family not in self.made:
            method = FAMILIES[family][0]
            out = {}
            for nproc in (1, 2):
                out[str(nproc)] = make_run(self.root, self.models(family), self.data,
                                           name=f"{family}-{nproc}", method=method, world=2,
                                           micro=2, dtype="fp64", seq_len=SEQ,
                                           lr=1e-2 if method == "full" else 3e-2,
                                           train={"max_steps": STEPS, "sample_every": "off"},
                                           data_extra={"eval_path": str(self.data)})  # fmt: skip
            # the uninterrupted 1-process run beside the 2-process run's first leg
            assert run_together((out["1"], 1, {}), (out["2"], 2, {"stop_at": STOP})) == [0, 0]
            assert run(out["2"], 2, resume=True) == 0
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
def test_one_and_two_processes_agree_through_a_stop_and_resume(family: str, runs: Runs) -> None:
    one, two = runs[family]["1"], runs[family]["2"]
    ends = events(two, "end")
    assert [(e["reason"], e["steps"]) for e in ends] == [("stopped", STOP), ("completed", STEPS)]
    assert [e["start_step"] for e in events(two, "start")] == [0, STOP]
    steps = events(two, "step")
    assert [e["step"] for e in steps] == list(range(1, STEPS + 1))
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.05, [e["loss"] for e in steps]
    losses_one = [e["loss"] for e in events(one, "step")]
    assert max(abs(a["loss"] - b) for a, b in zip(steps, losses_one, strict=True)) < 1e-9
    assert max_abs_diff(final_weights(two), final_weights(one)) < TOL
    method, adapted, never = FAMILIES[family]
    names = list(final_weights(two))
    if method == "lora":
        assert all("lora_" in n for n in names), names
        assert any(adapted in n for n in names), names
        assert not any(f".{m}." in n for n in names for m in never), names


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_result_evaluates_as_its_export(
    family: str, runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The runs evaluate their result on the training data at the last step (the validation
    `eval` shares, `train.evaluation.eval_loss.evaluate`); `eval` of the merged export says the same, and
    both beat the base model (step 1's loss: the base model on every sample). For Qwen3.5
    `eval` of the run folder itself (its adapter on the base) too."""
    one, two = runs[family]["1"], runs[family]["2"]

    def loss(model: Path) -> float:
        rc, out, err = run_cli(capsys, "eval", str(model), "--data", str(runs.data),
                               "--gpus", "cpu:1", "--seq-len", str(SEQ), "--json")  # fmt: skip
        assert rc == 0, err
        return float(json.loads(out)["loss"])

    (final,) = [e for e in events(two, "eval") if e["step"] == STEPS]
    # 1e-6: Nemotron-H's Mamba-2 scans in fp32 even in an fp64 run, and the ranks split the
    # eval rows otherwise than one process does
    assert [e["loss"] for e in events(one, "eval")] == pytest.approx([final["loss"]], rel=1e-6)
    merged = tmp_path / "merged"
    rc, _, err = run_cli(capsys, "export", str(two), "--format", "merged", "--out", str(merged),
                         "--json")  # fmt: skip
    assert rc == 0, err
    trained, exported = final["loss"], loss(merged)
    assert abs(trained - exported) < 1e-6 * trained, (trained, exported)
    base = events(two, "step")[0]["loss"]
    assert trained < base - 0.05, (trained, base)
    if family == "qwen3_5_text":  # `eval` of the run folder itself: its adapter on the base
        assert abs(loss(two) - exported) < 1e-6 * exported


@pytest.mark.parametrize("family", list(FAMILIES))
def test_measure_agrees_with_the_plan_which_packs_as_the_layers_allow(
    family: str,
    tiny_hybrid: Callable[[str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`homelab-dp measure` of a preset that packs, on data longer than seq_len (every row
    full): within 10% of the plan overall and in the forward and backward phases; the plan
    turned packing off for a recurrent family and says why, and kept it for the others, where
    the worker checked it on the real model."""
    data = tmp_path / "long.jsonl"
    rows = [{"instruction": "Count on.", "input": str(i), "output": " ".join(map(str, range(i, i + 60)))}
            for i in range(8)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    method = FAMILIES[family][0]
    preset = write_preset(tmp_path, family.replace("_", "-"), tiny_hybrid(family), data,
                          seq_len=64, pack=True, nproc=1, method=method, micro_batch=2,
                          grad_accum=1, max_steps=10)  # fmt: skip
    assert main(["measure", str(preset), "--steps", "2", "--json", "--no-store"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["method"], [r["rank"] for r in out["ranks"]]) == (method, [0])
    est, (rank,) = out["estimate"], out["ranks"]
    assert abs(out["error"]) <= BOUND, (est["tensor_bytes"], out["measured_peak_bytes"])
    for phase in ("forward", "backward"):
        got = rank["phases"][phase]["peak_bytes"]
        assert abs(est["phases"][phase] - got) / got <= BOUND, (phase, est["phases"][phase], got)
    run_dir = Path(out["run_dir"])
    packed = family not in RECURRENT
    assert read_run_spec(run_dir).preset.data.pack is packed
    off = [r for r in read_run_spec(run_dir).plan["reasons"] if r.startswith("Packing off")]
    assert (not off) if packed else (len(off) == 1 and RECURRENT[family] in off[0]), off
    assert events(run_dir, "start")[-1]["packing"] == ("exact" if packed else "off")
    assert [e["step"] for e in events(run_dir, "step")] == [1, 2]


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
