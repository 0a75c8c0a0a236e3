"""`homelab-dp eval` on preference pairs through the real CLI: torchrun workers on 2 CPU processes.

Two launches in all:
- the tiny model against itself as ``--reference`` (a second copy loaded): loss ln 2 and every
  reward 0, exactly (policy and reference compute the same bits);
- the tiny model after a few SGD steps made here, against the tiny model: the loss, rewards,
  margin and accuracy equal a direct fp64 computation in this process (one forward per sequence).
Bad input (no reference for a plain folder, KTO records, a reference for SFT data) is refused
before anything is spawned.
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ..conftest import ROOT, run_cli
from .conftest import DEMO_MODEL

pytestmark = pytest.mark.slow
PAIRS = ROOT / "assets" / "data" / "tiny-preferences.jsonl"
SEQ_LEN = 40  # some pairs are longer: truncation is part of what is compared
N_PAIRS = 20
BETA = 0.1  # the preset default: a plain folder has no run to take train.beta from


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The first N_PAIRS demo pairs, and one whose chosen and rejected are the same."""
    rows = [json.loads(line) for line in PAIRS.read_text(encoding="utf-8").splitlines()]
    rows = rows[:N_PAIRS] + [{"prompt": "Q: 1 + 1?\nA:", "chosen": " 2.", "rejected": " 2."}]
    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def stepped_model(tmp_path_factory: pytest.TempPathFactory, pairs_file: Path) -> Path:
    """The tiny model after 5 SGD steps on the chosen responses, saved (safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = tmp_path_factory.mktemp("stepped") / "model"
    shutil.copytree(DEMO_MODEL, folder, ignore=shutil.ignore_patterns("*.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        ids = torch.randint(3, 200, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def _eval(*args: str) -> dict[str, Any]:
    """`homelab-dp eval … --json` in a subprocess on 2 CPU processes: its document."""
    cmd = [sys.executable, "-m", "homelab_dp.cli", "eval", *args, "--gpus", "cpu:2",
           "--seq-len", str(SEQ_LEN), "--json"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout)


def direct(policy_dir: Path, reference_dir: Path, pairs: Path) -> dict[str, float]:
    """The DPO figures computed here: each sequence alone (prompt + response, at most SEQ_LEN
    inputs), fp64 log-softmax of fp32 logits, TRL's sigmoid loss on the sums."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from homelab_dp.data.samples import load_pairs
    from homelab_dp.presets.preset import DataSection

    tokenizer = AutoTokenizer.from_pretrained(DEMO_MODEL)
    data = DataSection(path=str(pairs), format="preference", seq_len=SEQ_LEN, pack=False)
    examples = load_pairs(data, tokenizer, objective="dpo", seq_len_limit=None).pairs
    models = [AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
              for d in (policy_dir, reference_dir)]  # fmt: skip

    def logp(model: Any, prompt: list[int], response: list[int]) -> float:
        ids = (prompt + response)[: SEQ_LEN + 1]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids[:-1]])).logits[0].double()
        lp = torch.log_softmax(logits, dim=-1)
        return sum(float(lp[t, ids[t + 1]]) for t in range(len(prompt) - 1, len(ids) - 1))

    losses, chosen, rejected = [], [], []
    for ex in examples:
        if ex.chosen == ex.rejected:
            continue
        pc, pr, rc, rr = (logp(m, ex.prompt, resp) for m in models
                          for resp in (ex.chosen, ex.rejected))  # fmt: skip
        h = (pc - pr) - (rc - rr)
        losses.append(math.log1p(math.exp(-BETA * h)))  # -log σ(βh)
        chosen.append(BETA * (pc - rc))
        rejected.append(BETA * (pr - rr))
    n = len(losses)
    return {
        "pairs": n,
        "loss": sum(losses) / n,
        "rewards_chosen": sum(chosen) / n,
        "rewards_rejected": sum(rejected) / n,
        "reward_margin": (sum(chosen) - sum(rejected)) / n,
        "reward_accuracy": sum(c > r for c, r in zip(chosen, rejected, strict=True)) / n,
    }


def test_model_against_itself_costs_ln2_exactly(pairs_file: Path) -> None:
    doc = _eval(str(DEMO_MODEL), "--data", str(pairs_file), "--reference", str(DEMO_MODEL))
    assert doc["loss"] == math.log(2)
    assert doc["reward_margin"] == 0.0
    assert doc["rewards_chosen"] == doc["rewards_rejected"] == 0.0
    assert doc["reward_accuracy"] == 0.0  # a tie is no win (TRL counts chosen > rejected)
    assert doc["pairs"] == N_PAIRS and doc["identical"] == 1
    assert doc["world_size"] == 2 and doc["beta"] == BETA and doc["loss_type"] == "sigmoid"
    assert doc["reference"] == DEMO_MODEL.name


def test_another_model_equals_the_direct_computation(pairs_file: Path, stepped_model: Path):
    doc = _eval(str(stepped_model), "--data", str(pairs_file), "--reference", str(DEMO_MODEL))
    want = direct(stepped_model, DEMO_MODEL, pairs_file)
    assert doc["pairs"] == want["pairs"] == N_PAIRS
    assert abs(doc["reward_margin"]) > 0.01  # the steps moved the model: a real comparison
    for key in ("loss", "rewards_chosen", "rewards_rejected", "reward_margin"):
        assert doc[key] == pytest.approx(want[key], abs=1e-5), key
    assert doc["reward_accuracy"] == want["reward_accuracy"]


@pytest.mark.parametrize(
    ("extra", "data", "says"),
    [
        ((), PAIRS, "no base to measure rewards against"),
        (("--reference", str(DEMO_MODEL)), ROOT / "assets" / "data" / "tiny-kto.jsonl", "KTO"),
        (("--reference", str(DEMO_MODEL)), ROOT / "assets" / "data" / "tiny-instruct.jsonl",
         "not preference data"),
    ],
    ids=["plain-folder-no-reference", "kto-records", "reference-for-sft-data"],
)  # fmt: skip
def test_bad_input_is_refused_before_anything_starts(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    extra: tuple[str, ...], data: Path, says: str,
) -> None:  # fmt: skip
    monkeypatch.setattr(subprocess, "Popen", _no_spawn)
    rc, out, err = run_cli(capsys, "eval", str(DEMO_MODEL), "--data", str(data), *extra,
                           "--gpus", "cpu:1", "--json")  # fmt: skip
    assert rc == 2 and out == ""
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: ") and says in lines[0], err
    assert lines[1].startswith("hint: ")


def _no_spawn(*args: Any, **kwargs: Any) -> Any:
    raise AssertionError(f"a process was spawned: {args}")
