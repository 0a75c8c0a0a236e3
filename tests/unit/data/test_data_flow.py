"""The data path reads top to bottom (docs/ARCHITECTURE.md, data/): the pipeline
(`homelab_dp.data.eval_split` over `homelab_dp.data.samples`) takes each step from one module,
and no step calls back up into the pipeline or into a later step, for SFT and preference data
alike, whether the token cache hits or misses."""

from __future__ import annotations

import ast
import json
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from homelab_dp.data.eval_split import load_preference_train_eval, load_train_eval
from homelab_dp.presets.preset import DataSection

ROOT = Path(__file__).resolve().parents[3]
DATA = ROOT / "homelab_dp" / "data"
MODEL = ROOT / "assets" / "models" / "tiny-llama"

PIPELINE = ("eval_split", "samples")
"""The top of the path: it calls the steps, in order."""
STEPS = ("sources", "reading", "columns", "records", "tokenize", "token_cache", "blocks",
         "preference_blocks")  # fmt: skip
"""The steps, in the order the data passes them (the cache is written after tokenizing, and
the blocks are cut from what it holds); a step may use an earlier one, never a later one."""
BESIDE = ("prompt_records", "sample_prompts")
"""GRPO's prompts and data.sample_prompts: read through the steps, used by no step."""


def test_every_data_module_has_its_place() -> None:
    modules = {p.stem for p in DATA.glob("*.py")} - {"__init__"}
    assert modules == set(PIPELINE + STEPS + BESIDE)


def _data_imports(name: str) -> set[str]:
    tree = ast.parse((DATA / f"{name}.py").read_text(encoding="utf-8"))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "homelab_dp.data":
                found |= {a.name for a in node.names}
            elif node.module.startswith("homelab_dp.data."):
                found.add(node.module.split(".")[2])
    return found


@pytest.mark.parametrize("name", STEPS + BESIDE)
def test_a_step_imports_only_earlier_steps(name: str) -> None:
    order = {m: i for i, m in enumerate(STEPS)}
    limit = order.get(name, len(STEPS))
    later = sorted(m for m in _data_imports(name) if order.get(m, len(STEPS)) >= limit)
    assert later == [], f"data/{name}.py imports {later}"


@pytest.fixture(scope="module")
def tok():
    transformers = pytest.importorskip("transformers")
    for heavy in ("pyarrow.ipc", "pandas", "jinja2"):  # imported here, not under the profiler
        pytest.importorskip(heavy)
    return transformers.AutoTokenizer.from_pretrained(MODEL)


def _calls(fn: Callable[[], object]) -> list[tuple[str, str, str]]:
    """Each call from one data/ module into another while ``fn`` runs: (caller, callee,
    function), in order."""

    def module(frame: object) -> str | None:
        path = Path(frame.f_code.co_filename)  # type: ignore[attr-defined]
        return path.stem if path.parent == DATA else None

    calls: list[tuple[str, str, str]] = []

    def profile(frame: object, event: str, _: object) -> None:
        if event != "call":
            return
        callee = module(frame)
        caller = module(frame.f_back) if frame.f_back else None  # type: ignore[attr-defined]
        if callee and caller and caller != callee:
            calls.append((caller, callee, frame.f_code.co_name))  # type: ignore[attr-defined]

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_loading_the_data_goes_down_the_steps_in_order(tok, tmp_path, monkeypatch, objective):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    if objective == "sft":
        records = [{"prompt": f"q{i}", "completion": f" a{i}"} for i in range(4)]
    else:
        records = [{"prompt": f"q{i}", "chosen": f" yes {i}", "rejected": f" no {i}"}
                   for i in range(4)]  # fmt: skip
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    data = DataSection(path=str(path), seq_len=32, eval_fraction=0.25)
    kw = dict(seed=1, seq_len_limit=512, min_blocks=1)

    def load() -> object:
        if objective == "sft":
            return load_train_eval(data, tok, **kw)
        return load_preference_train_eval(data, tok, objective=objective, **kw)

    order = {m: i for i, m in enumerate(PIPELINE + STEPS)}
    for cache in ("built", "hit"):
        calls = _calls(load)
        upward = [c for c in calls if c[0] not in PIPELINE and order[c[1]] >= order[c[0]]]
        assert upward == [], f"token cache {cache}: a step calls up or ahead: {upward}"
        # The pipeline enters the steps in the order the data passes them.
        steps = [callee for caller, callee, _ in calls if caller == "samples"]
        first = list(dict.fromkeys(s for s in steps if s not in ("records", "columns")))
        want = ["sources", "token_cache"]
        if cache == "built":
            want += ["reading", "tokenize"]
        assert first == want, f"token cache {cache}: {steps}"
        # Each step is entered once for this one file; the cache at most twice
        # (looked up, then written or its hit noted) and the tokenizer loaded once on a miss.
        counts = {s: steps.count(s) for s in set(steps)}
        assert counts.get("reading", 0) <= 1 and counts.get("tokenize", 0) <= 1
        assert counts["token_cache"] <= (3 if cache == "built" else 2)
        blocks = "blocks" if objective == "sft" else "preference_blocks"
        assert [c for c in calls if c[1] == blocks and c[0] == "eval_split"], calls
