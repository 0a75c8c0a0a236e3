"""FSDP2 loads one copy of the model: rank 0 reads it, every other rank only ever holds shards.

Measured with the worker's own memory probe (a measure run: live tensor bytes from before the
model is loaded, `train.memtrack`), on 2 CPU ranks under torchrun. DDP is the baseline: each of
its ranks holds the whole model. Under FSDP rank 1's load peak is its half of the weights, and
rank 0's is the copy it reads (freed tensor by tensor as it is sent) plus its own shard of the
tensor in flight. The weights themselves are checked bit for bit by test_equivalence.py,
test_resume.py and test_adapters.py, which load through the same path.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from homelab_dp.rundir.files import read_run_spec, write_run_spec
from tests.integration.conftest import events, make_run, run

pytestmark = pytest.mark.slow
SLACK = 64 * 1024  # the rotary buffers, the batch, the probe's own small tensors


def _load_peaks(root: Path, model: Path, data: Path, distribution: str, method: str) -> list[int]:
    """Each rank's live tensor bytes at the peak of the load phase (one measured step)."""
    rd = make_run(root, model, data, name=f"{method}-{distribution}", distribution=distribution,
                  method=method, train={"max_steps": 1})  # fmt: skip
    write_run_spec(rd, replace(read_run_spec(rd), measure_steps=1))
    assert run(rd, 2) == 0
    memory = events(rd, "memory")[-1]
    assert memory["kind"] == "live_tensor_bytes" and [r["rank"] for r in memory["ranks"]] == [0, 1]
    return [r["phases"]["load"]["peak_bytes"] for r in memory["ranks"]]


def test_fsdp_never_holds_the_model_on_more_than_one_rank(
    tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    from safetensors import safe_open

    with safe_open(tiny_model / "model.safetensors", "pt") as f:
        numels = [math.prod(f.get_slice(k).get_shape()) for k in f.keys()]  # noqa: SIM118
    model = 4 * sum(numels)  # fp32 weights
    largest = 4 * max(numels)
    data = data_dir / "ragged-16.jsonl"

    ddp = _load_peaks(tmp_path, tiny_model, data, "ddp", "full")
    print(f"ddp: model {model} B, load peak rank 0 {ddp[0]} B, rank 1 {ddp[1]} B")
    assert all(peak >= model for peak in ddp), (ddp, model)

    for distribution in ("fsdp-full", "fsdp-grad-op"):
        rank0, rank1 = _load_peaks(tmp_path, tiny_model, data, distribution, "full")
        print(f"{distribution}: model {model} B, largest tensor {largest} B, "
              f"load peak rank 0 {rank0} B, rank 1 {rank1} B")  # fmt: skip
        assert model / 2 <= rank1 <= model / 2 + SLACK, (rank1, model)
        assert model <= rank0 <= model + largest / 2 + SLACK, (rank0, model, largest)

    # LoRA: the frozen base (fp32 on the CPU) is sharded the same way; the adapters are tiny.
    rank0, rank1 = _load_peaks(tmp_path, tiny_model, data, "fsdp-full", "lora")
    assert model / 2 <= rank1 <= model / 2 + 2 * SLACK, (rank1, model)
    assert model <= rank0 <= model + largest / 2 + 2 * SLACK, (rank0, model, largest)
