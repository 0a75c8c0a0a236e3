#!/usr/bin/env python
"""Make the README screenshots with the TUI itself, and measure its time to first paint.

    python scripts/screenshots.py [--size 80x24] [--out assets/screenshots]

Writes ``plan.svg``, ``monitor.svg`` (the README's) and ``hardware.svg``, ``launch.svg``,
``runs.svg``, ``chat.svg``. Everything comes from recordings, so the pictures are the same on any machine:
two RTX 3090s joined by NVLink (``tests/data/nvml/2x3090-nvlink.json``) and the recorded LoRA
run of ``tests/data/events/``, replayed up to step 38 so that the Monitor shows a run in flight.
"""

from __future__ import annotations

import time

T0 = time.perf_counter()  # before Textual and the app are imported: part of the first paint

import argparse  # noqa: E402
import asyncio  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "tests" / "data" / "events" / "20250301-101500-smollm2-135m-lora-7f3a"
CUT_STEP = 38
"""Replay the recording up to the middle of this optimizer step."""


def in_flight_copy(root: Path) -> str:
    """The recorded run cut in the middle of step CUT_STEP, "running" (this process as keeper)."""
    run_dir = root / RECORDED.name
    shutil.copytree(RECORDED, run_dir)
    events = [json.loads(line) for line in (RECORDED / "events.jsonl").read_text().splitlines()]
    cut = next(e["time"] for e in events if e["type"] == "micro" and e["step"] == CUT_STEP)
    cut += 1.0  # two micro-steps into the step
    kept = [
        e for e in events if e["time"] <= cut and not (e["type"] == "state" and e is events[-1])
    ]
    (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in kept))
    samples = (RECORDED / "devices.jsonl").read_text().splitlines()
    kept_samples = [s for s in samples if json.loads(s)["time"] <= cut]
    (run_dir / "devices.jsonl").write_text("\n".join(kept_samples) + "\n")
    log = (RECORDED / "logs" / "launcher.log").read_text().splitlines()
    shown = [line for line in log if "step 40" not in line and "final" not in line]
    shown = [line for line in shown if "step-40" not in line and "exited" not in line]
    (run_dir / "logs" / "launcher.log").write_text("\n".join(shown) + "\n")
    state = json.loads((run_dir / "state.json").read_text())
    state.update(status="running", reason=None, ended=None, pids={"keeper": os.getpid()})
    (run_dir / "state.json").write_text(json.dumps(state))
    return run_dir.name


async def shoot(out: Path, size: tuple[int, int], runs: Path) -> dict[str, float]:
    """Visit every screen, save its SVG; return the startup timings in seconds."""
    from homelab_dp.app.runs import make_controller
    from homelab_dp.tui.tui_app import HomelabApp

    imported = time.perf_counter() - T0
    run_id = in_flight_copy(runs)
    app = HomelabApp(make_controller(runs), preset="smollm2-135m-lora-2x12gb", follow=run_id)
    started = time.perf_counter()
    async with app.run_test(size=size) as pilot:
        ready = time.perf_counter()
        # The first frame: the Hardware screen laid out (the compositor draws right after).
        while not app.screen.query("#hw-summary") or not app.screen.query_one("#hw-summary").region:
            await asyncio.sleep(0.001)
        painted = time.perf_counter()
        while app.screen.report is None:  # the probe runs in a thread: its cards come next
            await asyncio.sleep(0.001)
        probed = time.perf_counter()
        timings = {
            "import_s": imported,
            "app_ready_s": ready - started,
            "first_paint_s": painted - T0,
            "first_paint_after_import_s": painted - started,
            "probe_shown_s": probed - T0,
        }
        for key, name, ready_when in (
            ("1", "hardware", lambda: app.screen.report is not None),
            ("2", "plan", lambda: app.session.planned is not None),
            ("3", "launch", lambda: True),
            ("4", "monitor", lambda: app.screen.shown is not None),
            ("5", "runs", lambda: bool(app.screen.runs)),
            ("6", "chat", lambda: True),
        ):
            await pilot.press(key)
            while not ready_when():
                await pilot.pause(0.05)
            await pilot.pause()
            app.save_screenshot(f"{name}.svg", str(out))
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="80x24", help="terminal size, WIDTHxHEIGHT")
    parser.add_argument("--out", type=Path, default=ROOT / "assets" / "screenshots")
    args = parser.parse_args()
    width, height = (int(n) for n in args.size.lower().split("x"))
    os.chdir(ROOT)
    os.environ["HOMELAB_DP_FAKE_NVML"] = "tests/data/nvml/2x3090-nvlink.json"
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["XDG_CONFIG_HOME"] = str(Path(tmp) / "config")  # the shipped presets only
        os.environ["XDG_DATA_HOME"] = str(Path(tmp) / "data")  # not the user's run index
        runs = Path(tmp) / "runs"
        runs.mkdir()
        timings = asyncio.run(shoot(args.out, (width, height), runs))
    for name in ("hardware", "plan", "launch", "monitor", "runs", "chat"):
        print(f"wrote {args.out / (name + '.svg')}")
    print(
        f"time to first paint: {timings['first_paint_s'] * 1000:.0f} ms from start "
        f"(imports {timings['import_s'] * 1000:.0f} ms, app start to first frame "
        f"{timings['first_paint_after_import_s'] * 1000:.0f} ms); GPU cards shown after "
        f"{timings['probe_shown_s'] * 1000:.0f} ms"
    )


if __name__ == "__main__":
    main()
