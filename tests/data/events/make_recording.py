"""Write the recorded run replayed by the TUI tests: a 2-rank LoRA run of 40 steps.

    python tests/data/events/make_recording.py

Deterministic (seeded, fixed clock), so the snapshot tests stay stable. The story: SmolLM2-135M
with LoRA under DDP on two RTX 3090s; loss falls from ~2.9 to ~1.4; a checkpoint at step 20;
card 1 heats up and throttles from step 35, so rank 1 becomes a straggler before the end.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN_ID = "20250301-101500-smollm2-135m-lora-7f3a"
RUN_DIR = HERE / RUN_ID
T0 = 1740824100.0  # 2025-03-01 10:15:00 UTC: a fixed clock, never "now"
GiB = 1024**3
STEPS = 40
MICRO, ACCUM, WORLD, SEQ = 4, 4, 2, 2048
EFFECTIVE = MICRO * ACCUM * WORLD
ESTIMATE = 15_678_305_894  # the plan's per-device total (14.6 GiB) for this preset on 2x3090
THROTTLE_FROM = 35


def lr_at(step: int) -> float:
    """Linear warm-up over 5 steps to 1e-4, cosine decay to 1e-5."""
    if step <= 5:
        return 1e-4 * step / 5
    progress = (step - 5) / (STEPS - 5)
    return 1e-5 + 0.5 * (1e-4 - 1e-5) * (1 + math.cos(math.pi * progress))


def events(rng: random.Random) -> tuple[list[dict], float]:
    out: list[dict] = [
        {"type": "state", "time": T0, "status": "starting", "run_id": RUN_ID},
        {"type": "state", "time": T0 + 6.0, "status": "running"},
    ]
    t = T0 + 14.0  # model load and the process group take a few seconds
    out.append(
        {
            "type": "start", "time": t, "run_id": RUN_ID, "method": "lora", "distribution": "ddp",
            "total_steps": STEPS, "world_size": WORLD, "micro_batch": MICRO, "grad_accum": ACCUM,
            "effective_batch": EFFECTIVE, "seq_len": SEQ, "estimate_bytes": ESTIMATE,
            "device": "cuda", "dtype": "bf16", "start_step": 0,
        }
    )  # fmt: skip
    tokens = 0
    loss = 2.92
    for step in range(1, STEPS + 1):
        slow = 1.6 if step >= THROTTLE_FROM else 1.0  # a hot card: 60% slower
        base = 3.18 + rng.uniform(-0.05, 0.05)
        rank_times = [round(base, 3), round(base * slow + rng.uniform(-0.02, 0.02), 3)]
        step_time = max(rank_times) + 0.04  # every rank waits for the slowest at the all-reduce
        for k in range(1, ACCUM + 1):
            out.append(
                {"type": "micro", "time": round(t + step_time * k / ACCUM - 0.01, 3),
                 "step": step, "micro_step": k, "grad_accum": ACCUM}
            )  # fmt: skip
        t += step_time
        loss = 1.35 + (loss - 1.35) * 0.9 + rng.uniform(-0.04, 0.04)
        tokens += EFFECTIVE * SEQ
        out.append(
            {
                "type": "step", "time": round(t, 3), "step": step, "total_steps": STEPS,
                "epoch": round(step * EFFECTIVE / 2400, 4), "loss": round(loss, 4),
                "lr": lr_at(step), "tokens_per_s": round(EFFECTIVE * SEQ / step_time, 1),
                "samples_per_s": round(EFFECTIVE / step_time, 2), "micro_batch": MICRO,
                "grad_accum": ACCUM, "world_size": WORLD, "effective_batch": EFFECTIVE,
                "tokens": tokens, "step_time_s": round(step_time, 3),
                "rank_step_times_s": rank_times,
                "peak_memory_bytes": [14_931_000_000 + 1_000_000 * (step % 3), 14_912_000_000],
                "peak_memory_kind": "max_memory_allocated",
            }
        )  # fmt: skip
        if step == 20:
            t += 2.5
            path = f"checkpoints/step-{step}"
            out.append({"type": "checkpoint", "time": round(t, 3), "step": step, "path": path})
    t += 3.0
    out.append(
        {"type": "checkpoint", "time": round(t, 3), "step": STEPS, "path": "checkpoints/step-40"}
    )
    t += 4.0
    out.append(
        {"type": "end", "time": round(t, 3), "reason": "completed", "step": STEPS,
         "final_loss": round(loss, 4), "final_path": "final"}
    )  # fmt: skip
    out.append(
        {"type": "state", "time": round(t + 1.0, 3), "status": "completed", "reason": "completed"}
    )
    return out, t + 1.0


def samples(rng: random.Random, end: float) -> list[dict]:
    out = []
    energy = [0.0, 0.0]
    temps = [44.0, 46.0]
    step_start = T0 + 14.0
    throttle_at = step_start + (THROTTLE_FROM - 1) * 3.22
    t = T0 + 1.0
    while t < end:
        training = step_start <= t < end - 7.0
        devices = []
        for i in range(2):
            throttled = i == 1 and t >= throttle_at and training
            target = (83.0 if i == 1 else 72.0) if training else 45.0
            temps[i] += (target - temps[i]) * 0.08
            power = (262.0 if throttled else 334.0) if training else 41.0
            power += rng.uniform(-6, 6)
            energy[i] += power / 3600.0
            util = (
                (rng.randint(96, 100) if not throttled else rng.randint(58, 66)) if training else 0
            )
            used = (15.1 if i == 0 else 14.9) * GiB if training else 0.6 * GiB
            devices.append(
                {
                    "key": f"gpu{i}", "index": i, "name": "NVIDIA GeForce RTX 3090",
                    "utilization_pct": util, "memory_used": int(used), "memory_total": 24 * GiB,
                    "temperature_c": round(temps[i]), "power_w": round(power, 1),
                    "energy_wh": round(energy[i], 4),
                }
            )  # fmt: skip
        out.append(
            {"type": "devices", "time": round(t, 3), "devices": devices,
             "energy_wh": round(sum(energy), 4)}
        )  # fmt: skip
        t += 1.0
    return out


def spec() -> dict:
    return {
        "version": 1,
        "run_id": RUN_ID,
        "preset": {
            "model": {"path": "assets/models/smollm2-135m", "dtype": "auto", "trust_remote_code": False},
            "data": {"path": "assets/data/tiny-chat.jsonl", "format": "chat", "seq_len": SEQ, "pack": True},
            "train": {"method": "lora", "distribution": "ddp", "micro_batch": MICRO, "grad_accum": ACCUM,
                      "max_steps": STEPS, "lr": 1e-4, "warmup_steps": 5, "checkpoint_every": 20},
            "lora": {"r": 16, "alpha": 32},
            "hardware": {"devices": [0, 1], "nproc": 2},
            "cost": {"per_kwh": 0.32, "currency": "EUR"},
        },
        "preset_source": "presets/smollm2-135m-lora-2x12gb.toml",
        "resolved": {"method": "lora", "distribution": "ddp", "activation_checkpointing": False,
                     "device": "cuda", "world_size": WORLD, "dtype": "bf16", "micro_batch": MICRO,
                     "grad_accum": ACCUM, "lr": 1e-4},
        "plan": {"method": "lora", "distribution": "ddp", "fits": True,
                 "per_device_bytes": {"total": ESTIMATE}},
        "gpu_indices": [0, 1],
        "nproc_per_node": WORLD,
    }  # fmt: skip


def log_lines(evs: list[dict]) -> list[str]:
    lines = ["[keeper] torchrun started: 2 workers on 127.0.0.1:29511"]
    for e in evs:
        if e["type"] == "step" and e["step"] % 5 == 0:
            lines.append(f"[rank0] INFO step {e['step']}/{STEPS} loss {e['loss']:.4f}")
        elif e["type"] == "checkpoint":
            lines.append(f"[rank0] INFO checkpoint saved: {e['path']}")
    lines.append("[rank0] INFO wrote final adapter to final/")
    lines.append("[keeper] all workers exited 0: completed")
    return lines


def main() -> None:
    rng = random.Random(7)
    evs, end = events(rng)
    devs = samples(rng, end)
    (RUN_DIR / "logs").mkdir(parents=True, exist_ok=True)
    write_lines(RUN_DIR / "events.jsonl", evs)
    write_lines(RUN_DIR / "devices.jsonl", devs)
    (RUN_DIR / "spec.json").write_text(json.dumps(spec(), indent=2) + "\n", encoding="utf-8")
    state = {
        "status": "completed", "reason": "completed", "run_id": RUN_ID, "created": T0,
        "ended": round(end, 3), "exit_code": 0, "attempt": 1, "pids": {},
    }  # fmt: skip
    (RUN_DIR / "state.json").write_text(json.dumps(state, indent=2) + "\n", encoding="utf-8")
    (RUN_DIR / "logs" / "launcher.log").write_text("\n".join(log_lines(evs)) + "\n", "utf-8")
    print(f"{RUN_DIR}: {len(evs)} events, {len(devs)} device samples")


def write_lines(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


if __name__ == "__main__":
    main()
