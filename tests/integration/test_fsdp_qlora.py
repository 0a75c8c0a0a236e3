"""QLoRA under FSDP2 and offload on 2 CPU ranks (gloo): through the CLI it learns the adapter
QLoRA under DDP learns, offload changes no step, a stopped run resumes bit for bit, and the
streamed load never holds the model whole on rank 0.

Every run is the real worker under torchrun; the 4-bit weights are bitsandbytes' NF4 on the CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import write_preset
from tests.integration.conftest import (
    bitwise_equal,
    events,
    final_weights,
    make_run,
    max_abs_diff,
    run,
    run_detached,
)

pytestmark = pytest.mark.slow
QLORA = {"method": "qlora", "lr": 1e-2, "activation_checkpointing": True}
STEPS = {"max_steps": 4, "checkpoint_every": 2}


def test_qlora_under_fsdp_learns_the_adapter_qlora_under_ddp_learns(
    tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    """The same preset, three distributions, through `homelab-dp run`: the same losses and the
    same adapter, to float rounding (gradients reduce-scattered instead of all-reduced)."""
    preset = write_preset(tmp_path, "qlora", tiny_model, data_dir / "ragged-64.jsonl",
                          method="qlora", lr=1e-2, max_steps=6)  # fmt: skip
    # A liveness guard of 600 s a run: ~12 s each on an idle 2-core machine.
    runs = {d: run_detached(str(preset), "--set", f"train.distribution={d}", guard_s=600)
            for d in ("ddp", "fsdp-grad-op", "fsdp-full")}  # fmt: skip
    ddp = final_weights(runs["ddp"])
    ddp_losses = [e["loss"] for e in events(runs["ddp"], "step")]
    for dist in ("fsdp-grad-op", "fsdp-full"):
        start = events(runs[dist], "start")[-1]
        assert (start["method"], start["distribution"]) == ("qlora", dist)
        losses = [e["loss"] for e in events(runs[dist], "step")]
        assert len(losses) == 6 and losses == pytest.approx(ddp_losses, rel=1e-6)
        assert max_abs_diff(final_weights(runs[dist]), ddp) < 1e-6, dist


@pytest.fixture(scope="module")
def reference(tiny_model: Path, data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """QLoRA under FSDP2 full sharding, nothing offloaded, 4 steps uninterrupted."""
    root = tmp_path_factory.mktemp("qlora-fsdp")
    rd = make_run(root, tiny_model, data_dir / "ragged-16.jsonl", name="reference",
                  distribution="fsdp-full", train=STEPS, **QLORA)  # fmt: skip
    assert run(rd, 2) == 0
    assert events(rd, "end")[-1]["reason"] == "completed"
    start = events(rd, "start")[-1]
    assert (start["method"], start["distribution"]) == ("qlora", "fsdp-full")
    assert (rd / "final" / "adapter_config.json").is_file()  # a PEFT adapter, not a model
    return rd


def test_offloading_the_params_changes_no_step(
    reference: Path, tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    """FSDP2's CPU offload: the shards, gradients and AdamW state in host memory."""
    rd = make_run(tmp_path, tiny_model, data_dir / "ragged-16.jsonl", name="off-params",
                  distribution="fsdp-full", train=STEPS, offload="params", **QLORA)  # fmt: skip
    assert run(rd, 2) == 0
    losses = [e["loss"] for e in events(rd, "step")]
    assert losses == [e["loss"] for e in events(reference, "step")]
    assert bitwise_equal(final_weights(rd), final_weights(reference))


def test_a_stopped_run_with_optimizer_and_activations_offloaded_resumes_bit_for_bit(
    reference: Path, tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    """The optimizer state in host memory (`HostAdamW`) goes through the DCP checkpoint and
    back, and the saved activations through host memory (``train.parallelism.activation_offload``) every micro-step;
    the result equals that of the uninterrupted run, which offloaded nothing."""
    rd = make_run(tmp_path, tiny_model, data_dir / "ragged-16.jsonl", name="off-optimizer",
                  distribution="fsdp-full", train=STEPS, offload="optimizer",
                  offload_activations=True, **QLORA)  # fmt: skip
    assert run(rd, 2, stop_at=2) == 0
    assert events(rd, "end")[-1]["reason"] == "stopped"
    assert run(rd, 2, resume=True) == 0
    assert events(rd, "start")[-1]["start_step"] == 2
    assert bitwise_equal(final_weights(rd), final_weights(reference))


def _bigger_model(folder: Path, tokenizer_from: Path) -> int:
    """A seeded random LLaMA of 16 layers in bf16 (the dtype published checkpoints use), saved in
    several safetensors shards; its parameter count."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=768,
                         num_hidden_layers=16, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=128, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="8MB")
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def test_the_streamed_load_never_holds_the_model_whole(
    tiny_model: Path, data_dir: Path, tmp_path: Path
) -> None:
    """Measured (live tensor bytes, `homelab-dp measure`'s probe): rank 0's peak while loading
    stays below one 16-bit copy of the model, and below the 4-bit model it loads, whole."""
    model = tmp_path / "model"
    params = _bigger_model(model, tiny_model)
    assert len(list(model.glob("*.safetensors"))) > 1
    rd = make_run(tmp_path, model, data_dir / "ragged-16.jsonl", name="load", micro=1,
                  distribution="fsdp-full", measure_steps=1, **QLORA)  # fmt: skip
    assert run(rd, 2) == 0
    (memory,) = events(rd, "memory")
    ranks = {r["rank"]: r for r in memory["ranks"]}
    load = ranks[0]["phases"]["load"]["peak_bytes"]
    sixteen_bit = 2 * params
    assert load < sixteen_bit / 2, (load, sixteen_bit)
    # Each rank ends the load with its shards: together they are the whole loaded model.
    whole = sum(r["phases"]["load"]["end_bytes"] for r in ranks.values())
    print(f"rank 0 load peak {load} B, 16-bit copy {sixteen_bit} B, loaded on both {whole} B")
    assert load < whole, (load, whole)
