"""`homelab-dp measure` on tiny Qwen3.5 (Gated DeltaNet and gated attention) and Nemotron-H
(Mamba-2, attention, MLP and MoE layers) agrees with the plan within 10% (issue 36): one CPU
process, LoRA, two measured steps each, on the torch reference kernels (one module of two
launches, a few seconds each)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from homelab_dp.cli import main
from tests.conftest import write_preset

pytestmark = pytest.mark.slow
BOUND = 0.10


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "nemotron_h"])
def test_measure_on_a_tiny_hybrid_agrees_with_the_plan(
    model_type: str,
    tiny_hybrid: Callable[[str], Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = tmp_path / "long.jsonl"  # every sample longer than seq_len: every row full
    rows = [{"instruction": "Count on.", "input": str(i), "output": " ".join(map(str, range(i, i + 60)))}
            for i in range(8)]  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    preset = write_preset(tmp_path, model_type.replace("_", "-"), tiny_hybrid(model_type),
                          data, seq_len=64, nproc=1, method="lora",
                          micro_batch=2, grad_accum=1, max_steps=10)  # fmt: skip
    assert main(["measure", str(preset), "--steps", "2", "--json", "--no-store"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["method"], [r["rank"] for r in out["ranks"]]) == ("lora", [0])
    est, (rank,) = out["estimate"], out["ranks"]
    assert abs(out["error"]) <= BOUND, (est["tensor_bytes"], out["measured_peak_bytes"])
    for phase in ("forward", "backward"):
        got = rank["phases"][phase]["peak_bytes"]
        assert abs(est["phases"][phase] - got) / got <= BOUND, phase
