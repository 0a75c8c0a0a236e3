"""MoE and newer dense families train under the real launcher: DDP and FSDP2, LoRA and full.

Tiny random models of qwen3_moe, mixtral and gpt_oss (LoRA, the router frozen; gpt-oss with its
fused 3-D experts adapted through peft's ``target_parameters``) and of gemma3_text and olmo2
(full fine-tuning) are built here from their config classes with the demo tokenizer's
vocabulary. Each family trains once on 2 processes (micro 2) and once on 1 (the same spec:
accumulation 2 keeps the effective batch), in fp64: the loss falls, the router aux loss (where
the config asks for it) is trained on and logged, and the two results agree to fp64 rounding,
as the dense families do in test_equivalence.py: the two runs see the same micro-batches, so
routing (top-k over the router's fp32 probabilities) picks the same experts in both. The
Qwen3-MoE result is also evaluated and exported through the CLI (no extra training run).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from homelab_dp.runs.folder.run_folder import read_run_spec, write_run_spec
from tests.conftest import run_cli
from tests.integration.conftest import (
    DEMO_MODEL,
    events,
    final_weights,
    make_run,
    max_abs_diff,
    run_together,
)

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("results")]  # tests/conftest.py
TOL = 1e-12  # test_equivalence's: fp64 summation order (measured below 1e-15)

# family: (method, distribution, lora.target_modules or None)
FAMILIES: dict[str, tuple[str, str, Any]] = {
    "qwen3_moe": ("lora", "ddp", None),
    "mixtral": ("lora", "fsdp-full", None),
    "gpt_oss": ("lora", "ddp", ["all-linear", "experts"]),
    "gemma3_text": ("full", "fsdp-grad-op", None),
    "olmo2": ("full", "ddp", None),
    # QLoRA: every expert stack NF4 (nf4_quantization), streamed as rank 0 reads it
    "qwen3_moe/qlora": ("qlora", "ddp", None),
}
DTYPE = {"qwen3_moe/qlora": ("fp32", 1e-6)}
"""Runs not in fp64 (bitsandbytes' 4-bit matmul takes fp32 at most) and their tolerance."""
AUX = {"qwen3_moe": 0.01, "mixtral": 0.02}
"""Families whose config asks for the router aux loss (output_router_logits), and its weight."""


def build_model(family: str, out: Path) -> Path:
    """A seeded random model of ``family`` (hidden 32, 2 layers) with the demo tokenizer."""
    import torch
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(DEMO_MODEL)
    common: dict[str, Any] = dict(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    moe = dict(num_experts_per_tok=2, output_router_logits=family in AUX,
               router_aux_loss_coef=AUX.get(family, 0.0))  # fmt: skip
    sliding = dict(
        head_dim=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"]
    )
    config = {
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**common, **moe, intermediate_size=64,
                                               moe_intermediate_size=16, num_experts=4, head_dim=8),
        "mixtral": lambda: tf.MixtralConfig(**common, **moe, intermediate_size=16,
                                            num_local_experts=4),
        "gpt_oss": lambda: tf.GptOssConfig(**common, **moe, **sliding, intermediate_size=16,
                                           num_local_experts=4),
        "gemma3_text": lambda: tf.Gemma3TextConfig(**common, **sliding, intermediate_size=64),
        "olmo2": lambda: tf.Olmo2Config(**common, intermediate_size=64),
    }[family]()  # fmt: skip
    torch.manual_seed(0)
    path = out
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _run_pair(family: str, root: Path, data: Path) -> dict[str, Path]:
    """The family's 2-process run and the same spec on 1 process."""
    method, distribution, targets = FAMILIES[family]
    model = build_model(family.split("/")[0], root / family.replace("/", "-"))
    dtype = DTYPE.get(family, ("fp64", TOL))[0]
    name = family.replace("/", "-")
    out = {}
    for nproc in (2, 1):
        rd = make_run(root, model, data, name=f"{name}-{nproc}", method=method,
                      distribution=distribution, world=2, micro=2, dtype=dtype,
                      lr=1e-2 if method == "full" else 3e-2)  # fmt: skip
        spec = read_run_spec(rd)
        preset = spec.preset
        if targets is not None:
            preset = replace(preset, lora=replace(preset.lora, target_modules=targets))
        if family in PACKED:  # the default data.pack: the worker's packing check must pass
            preset = replace(preset, data=replace(preset.data, pack=True))
        write_run_spec(rd, replace(spec, preset=preset))
        out[str(nproc)] = rd
    assert run_together((out["2"], 2, {}), (out["1"], 1, {})) == [0, 0]
    return out


PACKED = ("gpt_oss",)
"""Families trained on packed blocks (data.pack = true, the default) here: gpt-oss, whose
forward keeps position_ids from the mask builder and whose sinks no fused kernel takes
(`train.model.packed_attention`)."""


class Runs:
    """Each family's pair of runs, made when a test first asks for it (module-scoped)."""

    def __init__(self, root: Path, data: Path) -> None:
        self.root, self.data = root, data
        self.made: dict[str, dict[str, Path]] = {}

    def __getitem__(self, family: str) -> dict[str, Path]:
        if family not in self.made:
            self.made[family] = _run_pair(family, self.root, self.data)
        return self.made[family]


@pytest.fixture(scope="module")
def runs(data_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """The families' runs, shared by the module's tests."""
    # Four samples, one effective batch: every step trains on the same batch, so the loss of
    # the last step is comparable with the first's.
    root = tmp_path_factory.mktemp("moe")
    lines = (data_dir / "ragged-12.jsonl").read_text(encoding="utf-8").splitlines()[:4]
    (root / "four.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return Runs(root, root / "four.jsonl")


@pytest.mark.parametrize("family", list(FAMILIES))
def test_trains_and_two_ranks_match_one(
    family: str, runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    two, one = runs[family]["2"], runs[family]["1"]
    if family == "qwen3_moe":  # in this test: pytest's other worker would train the pair again
        _moe_result_evaluates_and_exports(runs, tmp_path, capsys)
    steps = events(two, "step")
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert steps[-1]["loss"] < steps[0]["loss"] - 0.05, [e["loss"] for e in steps]
    assert events(two, "end")[-1]["reason"] == "completed"
    # The router's aux loss is trained on and logged where the config asks for it, the same
    # mean on 2 ranks as on 1 (the same micro-batches); none is logged where it does not.
    aux_two = [e.get("aux_loss") for e in steps]
    aux_one = [e.get("aux_loss") for e in events(one, "step")]
    if family.split("/")[0] in AUX:
        assert all(a is not None and a > 0 for a in aux_two), aux_two
        assert max(abs(a - b) for a, b in zip(aux_two, aux_one, strict=True)) < 1e-6 * aux_two[0]
    else:
        assert aux_two == [None] * len(steps), aux_two
    assert max_abs_diff(final_weights(two), final_weights(one)) < DTYPE.get(family, ("", TOL))[1]
    start = events(two, "start")[-1]
    assert start["world_size"] == 2 if "world_size" in start else True
    if family in PACKED:  # attention sinks in each sample's softmax: packing is exact
        assert start["packing"] == "exact" and start["packing_error"] < 1e-9, start
        assert steps[0]["attention_routes"] == {"sinks": 2 * 1}, steps[0]  # 2 layers, 1 micro
    method = FAMILIES[family][0]
    names = list(final_weights(two))
    if method in ("lora", "qlora"):
        assert all("lora_" in n for n in names)
        assert not any(".gate." in n or ".router." in n for n in names), names  # router frozen
        experts = [n for n in names if ".experts." in n]
        assert bool(experts) == (family == "gpt_oss"), names


def _moe_result_evaluates_and_exports(
    runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The Qwen3-MoE LoRA result (no new training run): `eval` of the run and of its merged
    export give the same loss, lower than the base model's on the data it trained on."""
    two = runs["qwen3_moe"]["2"]
    data = str(runs.data)

    def loss(model: Path) -> float:
        rc, out, err = run_cli(capsys, "eval", str(model), "--data", data, "--gpus", "cpu:1",
                               "--seq-len", "32", "--json")  # fmt: skip
        assert rc == 0, err
        return float(json.loads(out)["loss"])

    merged = tmp_path / "merged"
    rc, out, err = run_cli(capsys, "export", str(two), "--format", "merged", "--out", str(merged),
                           "--json")  # fmt: skip
    assert rc == 0, err
    assert (merged / "config.json").exists()
    trained, exported = loss(two), loss(merged)
    base = loss(runs.root / "qwen3_moe")
    assert abs(trained - exported) < 1e-3 * trained
    assert trained < base - 0.05, (trained, base)
