"""FSDP2 loads one copy of the model: rank 0 reads it, every other rank only ever holds shards.

Measured with the worker's own memory probe (a measure run: live tensor bytes from before the
model is loaded, `train.loop.memtrack`), on 2 CPU ranks under torchrun. DDP is the baseline: each of
its ranks holds the whole model. Under FSDP rank 1's load peak is its half of the weights, and
rank 0's is the copy it reads (freed tensor by tensor as it is sent) plus its own shard of the
tensor in flight. What is loaded is checked by training: here a tied lm_head (Qwen2-style) and
LoRA adapters drawn on rank 0 alone train to DDP's result in fp64; test_equivalence.py,
test_resume.py and test_adapters.py load FSDP runs through the same path.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest

from homelab_dp.runs.folder.run_folder import read_run_spec, write_run_spec
from tests.integration.conftest import (
    DEMO_MODEL,
    bitwise_equal,
    events,
    final_weights,
    make_run,
    max_abs_diff,
    run_together,
)

pytestmark = pytest.mark.slow
SLACK = 64 * 1024  # the rotary buffers, the batch, the probe's own small tensors
TOL = 1e-12  # fp64: summation order only (as in test_equivalence.py)


def _load_peaks(root: Path, model: Path, data: Path, *runs: tuple[str, str]) -> list[list[int]]:
    """Each run's ranks' live tensor bytes at the peak of the load phase (one measured step),
    per ``(distribution, method)``; the runs two at a time side by side (`run_together`: a
    tensor count, not a timing)."""
    dirs = []
    for distribution, method in runs:
        rd = make_run(root, model, data, name=f"{method}-{distribution}",
                      distribution=distribution, method=method,
                      train={"max_steps": 1})  # fmt: skip
        write_run_spec(rd, replace(read_run_spec(rd), measure_steps=1))
        dirs.append(rd)
    for pair in (dirs[i : i + 2] for i in range(0, len(dirs), 2)):
        assert run_together(*((rd, 2, {}) for rd in pair)) == [0] * len(pair)
    peaks = []
    for rd in dirs:
        memory = events(rd, "memory")[-1]
        assert memory["kind"] == "live_tensor_bytes"
        assert [r["rank"] for r in memory["ranks"]] == [0, 1]
        peaks.append([r["phases"]["load"]["peak_bytes"] for r in memory["ranks"]])
    return peaks


def test_fsdp_never_holds_the_model_on_more_than_one_rank(
    tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    from safetensors import safe_open

    with safe_open(tiny_model / "model.safetensors", "pt") as f:
        numels = [math.prod(f.get_slice(k).get_shape()) for k in f.keys()]  # noqa: SIM118
    model = 4 * sum(numels)  # fp32 weights
    largest = 4 * max(numels)
    data = data_dir / "ragged-16.jsonl"
    sharded = ("fsdp-full", "fsdp-grad-op")
    ddp, *fsdp, lora = _load_peaks(tmp_path, tiny_model, data, ("ddp", "full"),
                                   *((d, "full") for d in sharded), ("fsdp-full", "lora"))  # fmt: skip

    print(f"ddp: model {model} B, load peak rank 0 {ddp[0]} B, rank 1 {ddp[1]} B")
    assert all(peak >= model for peak in ddp), (ddp, model)

    for distribution, (rank0, rank1) in zip(sharded, fsdp, strict=True):
        print(f"{distribution}: model {model} B, largest tensor {largest} B, "
              f"load peak rank 0 {rank0} B, rank 1 {rank1} B")  # fmt: skip
        assert model / 2 <= rank1 <= model / 2 + SLACK, (rank1, model)
        assert model <= rank0 <= model + largest / 2 + SLACK, (rank0, model, largest)

    # LoRA: the frozen base (fp32 on the CPU) is sharded the same way; the adapters are tiny.
    rank0, rank1 = lora
    print(f"lora fsdp-full: load peak rank 0 {rank0} B, rank 1 {rank1} B")
    assert model / 2 <= rank1 <= model / 2 + 2 * SLACK, (rank1, model)
    assert model <= rank0 <= model + largest / 2 + 2 * SLACK, (rank0, model, largest)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded random Qwen2-style model: lm_head tied to the embeddings, q/k/v biases."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tied-model")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.mark.parametrize("method", ["full", "lora"])
def test_sharded_load_trains_as_ddp_tied_weights_and_adapters(
    method: str, tiny_model: Path, tied_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    """What FSDP loads is what DDP loads: the same result to fp64 rounding, for a tied lm_head
    (full fine-tune) and for LoRA adapters drawn from the seeded generator on rank 0 only."""
    model = tied_model if method == "full" else tiny_model
    data = data_dir / "ragged-16.jsonl"
    dirs = [make_run(tmp_path, model, data, name=f"{method}-{distribution}", method=method,
                     distribution=distribution, dtype="fp64", lr=1e-2)
            for distribution in ("ddp", "fsdp-full")]  # fmt: skip
    assert run_together(*((rd, 2, {}) for rd in dirs)) == [0, 0]
    ddp, fsdp = (final_weights(rd) for rd in dirs)
    if method == "full":  # still tied; FSDP's gathered result writes the lm_head out as well
        assert "lm_head.weight" not in ddp
        assert bitwise_equal(
            {"w": fsdp.pop("lm_head.weight")}, {"w": fsdp["model.embed_tokens.weight"]}
        )
    assert max_abs_diff(ddp, fsdp) < TOL
