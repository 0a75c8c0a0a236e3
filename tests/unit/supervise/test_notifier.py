"""What the keeper does once a run has ended (`supervise.keeper.after_end`), on recorded run
folders: the user's command runs once through the shell, with the run's id, state, summary and
folder in its environment and the summary on stdin, for a failed run too; a failing notifier is
logged and changes nothing; the command comes from the run spec, else the user's config file;
run data never becomes part of the command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from homelab_dp.runs.folder.run_state import read_state
from homelab_dp.supervise import notifier
from homelab_dp.supervise.keeper import after_end
from homelab_dp.user_files.paths import data_home
from tests.conftest import DATA

RECORDED = DATA / "events" / "20250301-101500-smollm2-135m-lora-7f3a"
NOTIFIER = (
    'printf "%s|%s|%s|%s|" "$HOMELAB_DP_RUN_ID" "$HOMELAB_DP_RUN_STATE" '
    '"$HOMELAB_DP_RUN_SUMMARY" "$HOMELAB_DP_RUN_DIR" >> {out}; cat >> {out}'
)


def ended_run(tmp_path: Path, status: str, notify: str | None, run_id: str = "r1") -> Path:
    run_dir = tmp_path / "runs" / run_id
    shutil.copytree(RECORDED, run_dir)
    spec = json.loads((run_dir / "spec.json").read_text())
    spec["run_id"] = run_id
    if notify is not None:
        spec["notify"] = notify
    (run_dir / "spec.json").write_text(json.dumps(spec))
    state = json.loads((run_dir / "state.json").read_text())
    state.update(status=status, reason="rank 1 died (SIGKILL)" if status == "failed" else None)
    (run_dir / "state.json").write_text(json.dumps(state))
    return run_dir


def test_a_failed_run_notifies_once_with_its_state_in_env_and_stdin(tmp_path: Path) -> None:
    out = tmp_path / "notified.txt"
    run_dir = ended_run(tmp_path, "failed", NOTIFIER.format(out=out))
    after_end(run_dir)
    run_id, state, summary, folder, stdin = out.read_text().split("|")
    assert (run_id, state, folder) == ("r1", "failed", str(run_dir))
    assert summary.startswith("r1 failed: step 40/40, loss ") and summary.endswith(
        "(rank 1 died (SIGKILL))"
    )
    assert stdin == summary + "\n"
    assert read_state(run_dir)["status"] == "failed"  # unchanged


def test_a_failing_notifier_is_logged_and_the_run_stays_completed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = ended_run(tmp_path, "completed", "echo broken >&2; exit 3")
    after_end(run_dir)
    assert "the notifier exited 3: broken" in capsys.readouterr().err
    assert read_state(run_dir)["status"] == "completed"


def test_run_data_reaches_the_command_only_through_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run id made of shell syntax is never run: the command is the user's, as typed."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "notified.txt"
    run_dir = ended_run(tmp_path, "completed", f'echo "$HOMELAB_DP_RUN_ID" > {out}',
                        run_id="x;touch pwned")  # fmt: skip
    after_end(run_dir)
    assert out.read_text() == "x;touch pwned\n" and not (tmp_path / "pwned").exists()


def test_the_config_files_command_is_used_when_the_run_has_none(tmp_path: Path) -> None:
    out = tmp_path / "from-config.txt"
    data_home().mkdir(parents=True, exist_ok=True)
    notifier.config_path().write_text(
        f"[notify]\ncommand = 'echo $HOMELAB_DP_RUN_STATE > {out}'\n", encoding="utf-8"
    )
    after_end(ended_run(tmp_path, "interrupted", None))
    assert out.read_text() == "interrupted\n"
    notifier.config_path().write_text("[notify\n", encoding="utf-8")  # broken: no command
    assert notifier.configured_command() is None


def test_no_command_no_notification(tmp_path: Path) -> None:
    assert notifier.configured_command() is None
    after_end(ended_run(tmp_path, "completed", None))  # nothing to run, nothing raised
