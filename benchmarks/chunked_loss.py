"""Full versus chunked cross-entropy on the CPU: peak extra bytes and time per forward+backward.

    python benchmarks/chunked_loss.py [--vocab 2048 32000 128256] [--tokens 512 2048]
                                      [--hidden 128] [--bf16] [--repeats 3] [--max-full-gib 4]

"full" is the worker's old path: ``F.linear`` to all logits, ``F.cross_entropy`` on their fp32
copy (reduction sum). "chunked" is `homelab_dp.train.model.loss.chunked_cross_entropy`. Peak extra
bytes are live tensor bytes above the inputs (hidden states, weight, labels), measured with
`homelab_dp.train.loop.memtrack.LiveTensors` over forward and backward, in a run of their own; the
time is the median of ``--repeats`` untracked runs. ``--bf16`` runs under CPU bf16 autocast,
the shape of the CUDA bf16 path (16-bit logits, fp32 loss). "model" is `chunk_peak_bytes`'s
bound (saved + the larger of forward and backward). A full run whose three fp32 logit tensors
would exceed ``--max-full-gib`` is skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from homelab_dp.planning.memory.device_memory import chunk_peak_bytes, chunk_tokens
from homelab_dp.train.loop.memtrack import LiveTensors
from homelab_dp.train.model.loss import chunked_cross_entropy

Loss = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def full_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The old path: all logits, then cross-entropy on their fp32 copy."""
    logits = F.linear(hidden, weight)
    return F.cross_entropy(
        logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
    )


def chunked_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The chunked path with its default chunk."""
    return chunked_cross_entropy(hidden, weight, None, labels)


def inputs(vocab: int, tokens: int, hidden: int) -> tuple[torch.Tensor, ...]:
    """Hidden states (1 × tokens × hidden), an fp32 weight and labels with a masked prompt."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, tokens, hidden, generator=g).requires_grad_()
    w = (torch.randn(vocab, hidden, generator=g) * hidden**-0.5).requires_grad_()
    y = torch.randint(0, vocab, (1, tokens), generator=g)
    y[:, : tokens // 8] = -100
    return h, w, y


def run_once(loss_fn: Loss, args: tuple[torch.Tensor, ...], autocast: bool) -> None:
    """One forward and backward, gradients cleared first."""
    h, w, y = args
    h.grad = w.grad = None
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with ctx:
        loss = loss_fn(h, w, y)
    loss.backward()


def peak_extra(loss_fn: Loss, args: tuple[torch.Tensor, ...], autocast: bool) -> int:
    """Live tensor bytes above the inputs at the peak of one forward+backward."""
    tracker = LiveTensors()
    tracker.track(args, "weights")
    tracker.reset_peak()
    base = tracker.current
    with tracker:
        run_once(loss_fn, args, autocast)
    return tracker.peak - base


def seconds(loss_fn: Loss, args: tuple[torch.Tensor, ...], autocast: bool, repeats: int) -> float:
    """Median wall time of one forward+backward."""
    run_once(loss_fn, args, autocast)  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        run_once(loss_fn, args, autocast)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, nargs="+", default=[2048, 32000, 128256])
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--bf16", action="store_true", help="CPU bf16 autocast")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-full-gib", type=float, default=4.0)
    a = p.parse_args()
    mib = 2**20
    print(f"hidden {a.hidden}, {'bf16 autocast' if a.bf16 else 'fp32'}, "
          f"{torch.get_num_threads()} threads; bytes in MiB")  # fmt: skip
    print(f"{'vocab':>7} {'tokens':>6} {'chunk':>5} {'full MiB':>9} {'chunk MiB':>9} "
          f"{'model MiB':>9} {'ratio':>6} {'full s':>7} {'chunk s':>7}")  # fmt: skip
    for vocab in a.vocab:
        for tokens in a.tokens:
            args = inputs(vocab, tokens, a.hidden)
            m = chunk_peak_bytes(
                vocab, a.hidden, tokens, 2 if a.bf16 else 4, weight_bytes=4, hidden_bytes=4
            )
            model = m["saved"] + max(m["forward"], m["backward"])
            chunked = peak_extra(chunked_loss, args, a.bf16)
            t_chunk = seconds(chunked_loss, args, a.bf16, a.repeats)
            if tokens * vocab * 12 <= a.max_full_gib * 2**30:
                full = peak_extra(full_loss, args, a.bf16)
                t_full = seconds(full_loss, args, a.bf16, a.repeats)
                cols = f"{full / mib:9.1f} {chunked / mib:9.1f} {model / mib:9.1f} " \
                       f"{chunked / full:6.3f} {t_full:7.3f} {t_chunk:7.3f}"  # fmt: skip
            else:
                cols = f"{'skipped':>9} {chunked / mib:9.1f} {model / mib:9.1f} {'':>6} " \
                       f"{'':>7} {t_chunk:7.3f}"  # fmt: skip
            print(f"{vocab:>7} {tokens:>6} {min(chunk_tokens(vocab), tokens):>5} {cols}")


if __name__ == "__main__":
    main()
