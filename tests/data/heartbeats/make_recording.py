"""Record the heartbeats the keeper saw during a real run whose result save took 20 s.

    python tests/data/heartbeats/make_recording.py          (about a minute on 2 CPU cores)

A 2-rank CPU run (torchrun, gloo) of 4 steps, ``train.watchdog_s = 6``,
``train.collective_timeout_s = 12``, with ``HOMELAB_DP_FAULT=slow-result:rank=0:step=4:seconds=20``
(rank 0 sleeps 20 s inside the result's work). The heartbeats were read every 0.2 s as the
keeper reads them; each line of ``slow-result.jsonl`` is one reading that differed from the one
before: ``{"t": seconds since the start, "beats": {rank: heartbeat without its pid}}``.
tests/unit/supervise/test_watchdog.py replays it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def main() -> None:
    sys.path.insert(0, str(ROOT))
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from homelab_dp.app.runs import make_controller
    from homelab_dp.runs.folder.heartbeats import read_heartbeats
    from homelab_dp.runs.folder.run_state import ACTIVE, current_state
    from tests.conftest import write_preset

    work = Path(tempfile.mkdtemp(prefix="heartbeats-"))
    tok = AutoTokenizer.from_pretrained(ROOT / "assets" / "models" / "tiny-llama")
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(work / "model")
    tok.save_pretrained(work / "model")
    lines = (ROOT / "assets" / "data" / "tiny-instruct.jsonl").read_text().splitlines()[:64]
    (work / "data.jsonl").write_text("\n".join(lines) + "\n")
    preset = write_preset(work, "slow", work / "model", work / "data.jsonl", max_steps=4,
                          checkpoint_every=2, watchdog_s=6, collective_timeout_s=12)  # fmt: skip
    controller = make_controller(work / "runs")
    os.environ["HOMELAB_DP_FAULT"] = "slow-result:rank=0:step=4:seconds=20"
    run_id = controller.start(controller.prepare(str(preset)))
    del os.environ["HOMELAB_DP_FAULT"]
    run_dir = controller.run_dir(run_id)
    t0, last, rows = time.monotonic(), None, []
    while current_state(run_dir).get("status") in ACTIVE:
        beats = read_heartbeats(run_dir)
        if beats and beats != last:
            last = beats
            keep = ("rank", "step", "micro", "phase", "time")
            rows.append({"t": round(time.monotonic() - t0, 2),
                         "beats": {str(r): {k: b[k] for k in keep}
                                   for r, b in sorted(beats.items())}})  # fmt: skip
        time.sleep(0.2)
    print(current_state(run_dir)["status"], current_state(run_dir).get("reason"))
    with open(HERE / "slow-result.jsonl", "w", encoding="utf-8") as fh:
        fh.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main()
