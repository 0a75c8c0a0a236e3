"""A run, eval and serve of a model given by Hugging Face id, offline, on a hub cache laid out
in a temporary folder (`tests/hub_cache.py`): the real CLI, controller, torchrun and replicas.

The three overlap (the server loads while the run trains and eval evaluates) to keep the test
short. What it checks: the run spec holds the local snapshot folder (workers never see the id)
and the id, revision and commit for display; eval and serve name the model by its id.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from homelab_dp.app.runs import make_controller
from homelab_dp.cli.main import main
from homelab_dp.hub.hub_models import ModelOrigin
from homelab_dp.render.runs import status_lines
from homelab_dp.runs.folder.run_folder import read_run_spec

from ..conftest import ROOT, write_preset
from ..hub_cache import COMMIT, REPO_ID, make_hub_cache, use_hub_cache
from .conftest import DEMO_DATA

pytestmark = pytest.mark.slow
LIVENESS_S = 240.0  # each part takes about 10 s on 2 cores


def _ready_line(out: Path, err: Path, proc: subprocess.Popen[bytes]) -> str:
    deadline = time.monotonic() + LIVENESS_S
    while not out.read_text().strip():
        assert proc.poll() is None, err.read_text()[-3000:]
        assert time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.1)
    return out.read_text()


def test_run_eval_and_serve_by_id_offline(tmp_path: Path, monkeypatch, capsys) -> None:
    cache = tmp_path / "hub"
    snapshot = make_hub_cache(cache)
    use_hub_cache(monkeypatch, cache)  # HF_HUB_OFFLINE=1 here and in every process spawned
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(DEMO_DATA.read_text().splitlines()[:48]) + "\n", encoding="utf-8")

    out, err = tmp_path / "serve.out", tmp_path / "serve.err"
    with open(out, "wb") as o, open(err, "wb") as e:
        server = subprocess.Popen(
            [sys.executable, "-m", "homelab_dp.cli", "serve", REPO_ID, "--gpus", "cpu:1",
             "--port", "0"], stdout=o, stderr=e, cwd=ROOT)  # fmt: skip
    try:
        preset = write_preset(tmp_path, "by-id", REPO_ID, data, max_steps=2)  # type: ignore[arg-type]
        assert main(["run", str(preset), "--detach", "--json", "--force"]) == 0
        run_id = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["run_id"]

        assert main(["eval", REPO_ID, "--data", str(data), "--gpus", "cpu:1", "--seq-len", "32",
                     "--json"]) == 0  # fmt: skip
        report = json.loads(capsys.readouterr().out)
        assert report["model"] == REPO_ID and report["loss"] > 0 and report["tokens"] > 0

        line = _ready_line(out, err, server)
        port = int(re.search(r":(\d+)/v1 ", line).group(1))
        assert line.startswith(f"serving {REPO_ID} on http://127.0.0.1:{port}/v1 with 1 replica")
        body = {"model": REPO_ID, "prompt": "The capital of", "max_tokens": 4, "temperature": 0}
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=120) as resp:
            doc = json.loads(resp.read())
        assert doc["model"] == REPO_ID and doc["usage"]["completion_tokens"] >= 1
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(30)
    assert server.returncode == 0, err.read_text()[-3000:]

    controller = make_controller()
    deadline = time.monotonic() + LIVENESS_S
    while (doc := controller.status(run_id))["status"] not in ("completed", "failed"):
        assert time.monotonic() < deadline, doc
        time.sleep(0.3)
    assert doc["status"] == "completed", doc["reason"]
    spec = read_run_spec(Path(doc["path"]))
    assert spec.preset.model.path == str(snapshot)  # the workers loaded the local folder
    assert spec.model_origin == ModelOrigin(REPO_ID, "", COMMIT)
    assert doc["model"] == {"path": str(snapshot), "repo_id": REPO_ID, "revision": "",
                            "commit": COMMIT}  # fmt: skip
    assert f"model     {REPO_ID} (main, commit {COMMIT[:7]})" in status_lines(doc)
