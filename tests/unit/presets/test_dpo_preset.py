"""presets/llama3-8b-dpo-qlora-2x24gb.toml plans to fit the recorded 2 × RTX 3090 (NVLink)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import DATA, run_cli

GiB = 2**30


def test_llama3_8b_dpo_qlora_fits_two_3090s(
    in_repo: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("HOMELAB_DP_FAKE_NVML", str(DATA / "nvml" / "2x3090-nvlink.json"))
    rc, out, err = run_cli(capsys, "plan", "llama3-8b-dpo-qlora-2x24gb", "--json")
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["hardware"]["kind"] == "cuda" and len(doc["hardware"]["devices"]) == 2
    assert doc["fits"] is True and (doc["method"], doc["distribution"]) == ("qlora", "ddp")
    total = doc["per_device_bytes"]["total"]
    assert total <= 0.95 * 24 * GiB
    # Two sequences of 1024 per pair, packed into one row of 2048: the full logits of both
    # (bf16 logits of every token, fp32 copies of the targets) are the loss head.
    vocab = doc["model"]["vocab"]
    assert doc["per_device_bytes"]["logits"] == 2048 * vocab * (3 * 4 + 2)
    dpo = next(r for r in doc["reasons"] if r.startswith("DPO:"))
    assert "1 row of 2048 tokens" in dpo and "adapters disabled" in dpo

    # SFT of the same preset: one sequence of 1024 per sample, and the chunked loss head.
    def sft(*sets: str) -> dict:
        argv = ["--set", "train.objective=sft", "--set", "train.activation_checkpointing=true"]
        for s in sets:
            argv += ["--set", s]
        rc, out, err = run_cli(capsys, "plan", "llama3-8b-dpo-qlora-2x24gb", "--json", *argv)
        assert rc == 0, err
        return json.loads(out)["per_device_bytes"]

    assert sft()["total"] < total
