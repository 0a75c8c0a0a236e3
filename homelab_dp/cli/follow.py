"""Following a run from the CLI: a rich live panel on a terminal, plain lines elsewhere, or JSON.

To follow a run is to show it as it goes until it ends or the watcher leaves, never touching
the run: `run` and `resume` follow the run they start unless ``--detach``, and `attach` follows
one already going (the TUI follows one run at a time the same way, `homelab_dp.app.follow`).
Reading what the run's files gained is tailing (`homelab_dp.runs.folder.jsonl_tail`); how the run looks is
`homelab_dp.render.run_view`; this module is the loop between them.

When stdout is a terminal the panel redraws in place; under nohup, in a log file or a pipe it
prints one timestamped line per logged step instead; ``--json`` prints every event as a JSON
line. Ctrl-C only detaches: the run goes on.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from homelab_dp import json_safe
from homelab_dp.app.follow import RunFollower, RunView, is_live
from homelab_dp.app.runs import RunController
from homelab_dp.render.run_view import event_line, final_text, live_panel
from homelab_dp.vocabulary import EXIT_CODE_BY_STATUS

POLL_S = 0.25


def follow(
    controller: RunController,
    run_id: str,
    mode: str,
    out: TextIO | None = None,
    history_until: int | None = None,
) -> int:
    """Follow ``run_id`` until it ends; ``mode`` is "live", "plain" or "json". Returns exit code.

    Events before byte ``history_until`` of events.jsonl (default: all there are now) are
    history: folded into the view without being printed, so only what happens from now on is.
    ``out`` defaults to the sys.stdout of the moment (not of the import: a caller in the same
    process may have swapped it since).
    """
    out = sys.stdout if out is None else out
    run = RunFollower(controller, run_id, history_until)
    run_dir, view = run.run_dir, run.view
    if mode == "plain" and view.step:
        sys.stderr.write(f"attached at step {view.step}/{view.total_steps}\n")
    printer = _Printer(mode, out, view)
    try:
        with printer:
            while True:
                state = run.state()
                for event in run.events():
                    printer.event(event)
                if not is_live(state.get("status")):
                    for event in run.events():  # drain what the end wrote
                        printer.event(event)
                    view.apply_state(state)
                    printer.final(state)
                    # How the processes ended, whatever the events said ("unknown" fails).
                    return EXIT_CODE_BY_STATUS.get(state.get("status", view.status), 1)
                printer.tick()
                time.sleep(POLL_S)
    except KeyboardInterrupt:
        sys.stderr.write(
            f"\ndetached; the run goes on. Re-attach with: homelab-dp attach {run_dir.name}\n"
        )
        return 130


class _Printer:
    """Writes a followed run in one of the three modes."""

    def __init__(self, mode: str, out: TextIO, view: RunView) -> None:
        self.mode, self.out, self.view = mode, out, view
        self.live = None
        self._last_devices = 0.0

    def __enter__(self) -> _Printer:
        if self.mode == "live":
            from rich.live import Live

            self.live = Live(live_panel(self.view), refresh_per_second=4, transient=False)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.update(live_panel(self.view))
            self.live.__exit__(None, None, None)

    def _plain(self, text: str) -> None:
        self.out.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
        self.out.flush()

    def event(self, e: dict[str, Any]) -> None:
        if self.mode == "json":
            self.out.write(json_safe.dumps(e) + "\n")
            self.out.flush()
        elif self.mode == "plain":
            if e.get("type") == "devices":  # a sample a second: a line every 10 s at most
                if time.time() - self._last_devices < 10:
                    return
                self._last_devices = time.time()
            text = event_line(e, self.view)
            if text is not None:
                self._plain(text)

    def tick(self) -> None:
        if self.live is not None:
            self.live.update(live_panel(self.view))

    def final(self, state: dict[str, Any]) -> None:
        if self.mode == "json":
            return
        text = final_text(self.view, state)
        if self.mode == "plain":
            self._plain(text)
        else:
            self.tick()
            self.out.write(text + "\n")
