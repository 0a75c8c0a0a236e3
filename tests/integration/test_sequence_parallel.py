"""Sequence parallelism (issue 38, item 3): every sequence split over 2 ranks trains exactly as
one rank with the whole sequence, and holds half its activations.

Exactness (the real launcher: torchrun, the worker, gloo): one rank without the split and 2
ranks with ``train.sequence_parallel = 2`` (ZeRO-1) fully fine-tune the same tiny model (4
query heads, 1 key/value head: repeated for the split) on the same packed blocks of 2,048
tokens, samples straddling the split at token 1,024; the 2-rank run is stopped after
step 2 and resumed. Its losses and final weights equal the uninterrupted 1-rank run's to fp64
rounding (1e-10); its step events carry the all-to-alls in ``comm_seconds``, its start event
the split.

Memory (`homelab-dp measure` through the CLI, LoRA, fp32): each rank of the split holds at most
0.6 of one rank's activations and logits, and within 10% of what the plan says for the split.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from homelab_dp.cli import main
from tests.conftest import write_preset
from tests.integration.conftest import (
    DEMO_MODEL,
    events,
    final_weights,
    make_run,
    max_abs_diff,
    run,
    run_together,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("results")]  # tests/conftest.py
ROOT = Path(__file__).resolve().parents[2]
TEXT = ROOT / "assets" / "data" / "tiny-text.jsonl"
SEQ = 2048
TOL = 1e-10


@pytest.fixture(scope="module")
def long_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A seeded LLaMA-style model of 2,048+ positions with one key/value head."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("long-model")
    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def runs(long_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The 1-rank run, and the 2-rank split run (ZeRO-1: DDP's all-reduce and a sharded
    optimizer state to checkpoint) stopped after step 2 and resumed."""
    root = tmp_path_factory.mktemp("sp")
    common = {
        "micro": 1,
        "dtype": "fp64",
        "seq_len": SEQ,
        "pack": True,
        "lr": 1e-2,
        "data_extra": {"eval_fraction": 0.2},
    }  # evaluated after the last step
    one = make_run(root, long_model, TEXT, name="one", world=1, **common)
    two = make_run(root, long_model, TEXT, name="split", world=2, sequence_parallel=2,
                   distribution="zero1", train={"checkpoint_every": 1}, **common)  # fmt: skip
    assert run_together((one, 1, {}), (two, 2, {"stop_at": 2})) == [0, 0]
    assert events(two, "end")[-1]["reason"] == "stopped"
    assert run(two, 2, resume=True) == 0
    return {"one": one, "split": two}


def test_split_run_equals_one_rank(runs: dict[str, Path]) -> None:
    one, two = runs["one"], runs["split"]
    losses_one = {e["step"]: e["loss"] for e in events(one, "step")}
    losses_two = {e["step"]: e["loss"] for e in events(two, "step")}
    assert sorted(losses_one) == sorted(losses_two) == [1, 2, 3]
    for step, loss in losses_one.items():
        assert abs(losses_two[step] - loss) < TOL, (step, loss, losses_two[step])
    assert max_abs_diff(final_weights(one), final_weights(two)) < TOL
    assert events(two, "end")[-1]["reason"] == "completed"
    (eval_one,), (eval_two,) = events(one, "eval"), events(two, "eval")  # split as well
    assert eval_one["step"] == eval_two["step"] == 3 and eval_one["tokens"] == eval_two["tokens"]
    assert abs(eval_one["loss"] - eval_two["loss"]) < TOL
    starts = events(two, "start")
    assert [e["sequence_parallel"] for e in starts] == [2, 2]
    assert [e["start_step"] for e in starts] == [0, 2]
    assert events(one, "start")[0]["sequence_parallel"] == 1
    for e in events(two, "step"):  # DDP's all-reduce and the all-to-alls, timed
        assert e["comm_seconds"] > 0 and e["world_size"] == 2 and e["effective_batch"] == 1
    assert all(e["comm_seconds"] is None for e in events(one, "step"))


def test_packed_samples_straddle_the_split(runs: dict[str, Path]) -> None:
    """The blocks trained hold samples across token 1,024 (the split), read from the run's own
    token cache through the data loader the worker uses."""
    from transformers import AutoTokenizer

    from homelab_dp.data.eval_split import load_train_eval
    from homelab_dp.runs.folder.run_folder import read_run_spec

    spec = read_run_spec(runs["split"])
    tokenizer = AutoTokenizer.from_pretrained(spec.preset.model.path)
    blocks = load_train_eval(spec.preset.data, tokenizer, seed=spec.preset.train.seed,
                             seq_len_limit=4096, min_blocks=1).train  # fmt: skip
    straddle = [b for b in blocks if b.position_ids[SEQ // 2] > 0]
    assert len(blocks) >= 3 and len(straddle) >= len(blocks) // 2


def _measure(tmp: Path, name: str, model: Path, nproc: int, sp: int, capsys) -> dict:
    preset = write_preset(tmp, name, model, TEXT, seq_len=SEQ, pack=True, nproc=nproc,
                          micro_batch=1, grad_accum=1, sequence_parallel=sp,
                          method="lora")  # fmt: skip
    assert main(["measure", str(preset), "--steps", "2", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_measure_shows_half_the_activations_per_rank_as_planned(
    long_model: Path, tmp_path: Path, capsys
) -> None:
    one = _measure(tmp_path, "sp-one", long_model, 1, 1, capsys)
    two = _measure(tmp_path, "sp-two", long_model, 2, 2, capsys)
    whole = one["ranks"][0]["peak_by_category"]["other"]  # activations, logits, temporaries
    plan = two["estimate"]["per_device_bytes"]
    planned = plan["activations"] + plan["logits"]
    assert len(two["ranks"]) == 2
    for r in two["ranks"]:
        mine = r["peak_by_category"]["other"]
        assert mine <= 0.6 * whole, (mine, whole)
        assert abs(mine - planned) / mine <= 0.10, (mine, planned)
    assert abs(two["error"]) <= 0.10  # the tensors' peak as a whole, as planned
