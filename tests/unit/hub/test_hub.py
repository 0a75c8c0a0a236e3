"""Models by Hugging Face id (`hub.hub_models`, `runs.model_ref`, `plan --model`, `pull`), on a
hub cache laid out in a temporary folder (`tests/hub_cache.py`), offline.

Where a download is the point, huggingface_hub's two download functions are replaced by fakes
that stand for the Hub (the network boundary): they lay the files out as the real ones do, or
raise the errors the real ones raise. Nothing here reaches the network.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import huggingface_hub
import pytest
from huggingface_hub import errors
from huggingface_hub.utils import filter_repo_objects

from homelab_dp.errors import HomelabError, ModelSpecError
from homelab_dp.hub.hub_models import NotCachedError, missing_parts, resolve_model_id
from homelab_dp.runs.model_ref import is_model_id, resolve_model_arg
from tests.conftest import ROOT, run_cli
from tests.hub_cache import (
    COMMIT,
    DEMO_MODEL,
    REPO_ID,
    TAG_COMMIT,
    add_snapshot,
    make_hub_cache,
    use_hub_cache,
)


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The demo model cached as REPO_ID (main: whole; tag v1: config.json only), offline."""
    cache = tmp_path / "hub"
    make_hub_cache(cache)
    use_hub_cache(monkeypatch, cache)
    return cache


def snapshot(cache: Path, commit: str = COMMIT) -> Path:
    return cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / commit


def test_a_cached_id_resolves_to_its_snapshot_by_branch_tag_or_commit(hub: Path) -> None:
    snap = resolve_model_id(REPO_ID)
    assert snap.folder == snapshot(hub) and snap.commit == COMMIT
    assert (snap.origin.repo_id, snap.origin.revision, snap.origin.commit) == (REPO_ID, "", COMMIT)
    assert missing_parts(snap.folder) == []
    assert resolve_model_id(REPO_ID, COMMIT).folder == snapshot(hub)
    # The tag v1 holds config.json only: enough to plan, not to run.
    assert resolve_model_id(REPO_ID, "v1", config_only=True).folder == snapshot(hub, TAG_COMMIT)
    with pytest.raises(NotCachedError) as info:
        resolve_model_id(REPO_ID, "v1")
    assert f"{REPO_ID}@v1" in info.value.message and "weights (*.safetensors)" in info.value.message
    assert f"homelab-dp pull {REPO_ID} --revision v1" in info.value.hint


def test_offline_and_not_cached_names_the_id_and_the_cache(hub: Path, capsys) -> None:
    with pytest.raises(NotCachedError) as info:
        resolve_model_id("someone/missing", config_only=True)
    assert "someone/missing" in info.value.message and str(hub) in info.value.message
    assert "HF_HUB_OFFLINE" in info.value.message
    assert "homelab-dp pull someone/missing" in info.value.hint
    for argv in (["plan", "--model", "someone/missing", "--gpus", "24GiB"],
                 ["pull", "someone/missing"], ["eval", "someone/missing", "--data", "x.jsonl"]):  # fmt: skip
        rc, out, err = run_cli(capsys, *argv)
        assert rc == 2 and out == "", argv
        assert err.startswith("error: model someone/missing") and str(hub) in err, err
        assert "hint: download it with `homelab-dp pull someone/missing`" in err


def test_plan_by_id_equals_plan_by_folder_and_of_the_preset(hub: Path, in_repo, capsys) -> None:
    """`plan --model` with tiny-demo's settings answers what `plan tiny-demo` answers."""
    demo = ["--set", "train.grad_accum=2", "--set", "train.lr=3e-3", "--set",
            "train.warmup_steps=5", "--seq-len", "256", "--micro-batch", "4"]  # fmt: skip
    docs = []
    for argv in (["plan", "tiny-demo"], ["plan", "--model", REPO_ID, *demo],
                 ["plan", "--model", str(DEMO_MODEL), *demo]):  # fmt: skip
        rc, out, _ = run_cli(capsys, *argv, "--gpus", "cpu:2:8GiB", "--json")
        assert rc == 0
        docs.append(json.loads(out))
        docs[-1].pop("recorded_runs", None)  # what was measured of the preset by that name
    assert docs[0]["per_device_bytes"]["total"] > 0
    assert docs[1] == docs[0] and docs[2] == docs[0]
    rc, out, _ = run_cli(capsys, "plan", "--model", REPO_ID, "--method", "lora", "--gpus",
                         "24GiB", "--revision", "v1", "--json")  # fmt: skip
    assert rc == 0 and json.loads(out)["method"] == "lora"


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["plan"], "give a preset (PRESET) or a model"),
        (["plan", "tiny-demo", "--model", REPO_ID], "give a preset or --model, not both"),
        (["plan", "--model", "no/such/folder"], "--model no/such/folder: no such folder"),
        (["pull", "./not-an-id"], "pull ./not-an-id: not a Hugging Face id"),
    ],
)
def test_bad_model_arguments(argv, needle, hub: Path, in_repo, capsys) -> None:
    rc, _, err = run_cli(capsys, *argv)
    assert rc == 2 and needle in err and "hint: " in err and "Traceback" not in err


def test_pull_offline_prints_the_cached_snapshot(hub: Path, capsys) -> None:
    rc, out, _ = run_cli(capsys, "pull", REPO_ID)
    assert rc == 0 and out == f"{snapshot(hub)}\n"
    rc, out, _ = run_cli(capsys, "pull", REPO_ID, "--revision", "v1", "--config-only", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["folder"] == str(snapshot(hub, TAG_COMMIT)) and doc["cache"] == str(hub)
    assert (doc["commit"], doc["revision"], doc["config_only"]) == (TAG_COMMIT, "v1", True)


def test_model_argument_by_id(hub: Path, tmp_path: Path, monkeypatch) -> None:
    ref = resolve_model_arg(REPO_ID)
    assert (ref.name, ref.path, ref.base) == (REPO_ID, snapshot(hub), None)
    assert resolve_model_arg(f"{REPO_ID}@v1", config_only=True).path == snapshot(hub, TAG_COMMIT)
    with pytest.raises(NotCachedError):
        resolve_model_arg(f"{REPO_ID}@v1")  # eval, chat and serve need the weights
    monkeypatch.chdir(tmp_path)
    (tmp_path / "homelab-test" / "tiny-llama").mkdir(parents=True)
    assert not is_model_id(REPO_ID)  # a folder of that name here wins over the id
    with pytest.raises(HomelabError, match="not a model folder"):
        resolve_model_arg(REPO_ID)


def test_plan_by_id_imports_no_torch(hub: Path) -> None:
    code = (
        "import json, sys, io, contextlib\n"
        "from homelab_dp.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    rc = main(['plan', '--model', {REPO_ID!r}, '--gpus', '24GiB', '--json'])\n"
        "print(json.dumps([rc] + [m for m in ('torch', 'transformers', 'textual')"
        " if m in sys.modules]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT
    )
    assert json.loads(out.stdout.splitlines()[-1]) == [0]


# ---------------------------------------------------------------------- online (a fake Hub)
REMOTE = ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
          "chat_template.jinja", "pytorch_model.bin", "original/consolidated.pth",
          "onnx/model.onnx", "README.md"]  # fmt: skip
"""The files of the fake Hub's repository: safetensors beside pickles and other formats."""


class FakeHub:
    """huggingface_hub's download functions, answering as the Hub would: from the cache when
    ``local_files_only``, else "downloading" the demo model's files (``fail``: raising it)."""

    def __init__(self, cache: Path, fail: Exception | None = None) -> None:
        self.cache, self.fail, self.downloads = cache, fail, []

    def _download(self, files: list[str]) -> Path:
        if self.fail is not None:
            raise self.fail
        self.downloads.append(files)
        sources = [
            DEMO_MODEL / f if (DEMO_MODEL / f).exists() else DEMO_MODEL / "README.md" for f in files
        ]
        folder = add_snapshot(self.cache, REPO_ID, COMMIT, [])
        for name, src in zip(files, sources, strict=True):
            target = folder / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(src.read_bytes())
        return folder

    def hf_hub_download(self, repo_id: str, filename: str, **kw: Any) -> str:
        if kw.get("local_files_only"):
            raise errors.LocalEntryNotFoundError("not cached")
        return str(self._download([filename]) / filename)

    def snapshot_download(self, repo_id: str, **kw: Any) -> str:
        if kw.get("local_files_only"):
            raise errors.LocalEntryNotFoundError("not cached")
        wanted = filter_repo_objects(REMOTE, allow_patterns=kw.get("allow_patterns"),
                                     ignore_patterns=kw.get("ignore_patterns"))  # fmt: skip
        return str(self._download(sorted(wanted)))


@pytest.fixture
def online(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeHub:
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    fake = FakeHub(cache)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake.snapshot_download)
    return fake


def test_online_planning_fetches_config_json_only_and_a_run_the_model(online: FakeHub) -> None:
    assert resolve_model_id(REPO_ID, config_only=True).folder == snapshot(online.cache)
    assert online.downloads == [["config.json"]]
    snap = resolve_model_id(REPO_ID)
    # Safetensors, tokenizer, config and template: no pickle, nothing from a sub-folder.
    assert online.downloads[1] == ["chat_template.jinja", "config.json", "model.safetensors",
                                   "tokenizer.json", "tokenizer_config.json"]  # fmt: skip
    assert missing_parts(snap.folder) == []


def _response(status: int) -> Any:
    """What huggingface_hub's HTTP errors keep of the Hub's answer."""
    return SimpleNamespace(status_code=status, headers={}, request=None)


@pytest.mark.parametrize(
    ("error", "message", "hint"),
    [
        (errors.GatedRepoError("gated", response=_response(403)), "gated on the Hugging Face Hub",
         "hf auth login` (or set HF_TOKEN)"),
        (errors.RepositoryNotFoundError("nope", response=_response(404)),
         "no such model on the Hugging Face Hub", "a private model needs `hf auth login`"),
        (errors.RevisionNotFoundError("nope", response=_response(404)), "no revision 'dev'",
         "branch, tag or commit"),
        (errors.LocalEntryNotFoundError("connection refused"), "the Hub could not be reached",
         f"`homelab-dp pull {REPO_ID}` on a machine online"),
    ],
)  # fmt: skip
def test_hub_errors_become_an_error_and_a_hint(online: FakeHub, error, message, hint) -> None:
    online.fail = error
    with pytest.raises(ModelSpecError) as info:
        resolve_model_id(REPO_ID, "dev", config_only=True)
    assert message in info.value.message and REPO_ID in info.value.message
    assert hint in info.value.hint
