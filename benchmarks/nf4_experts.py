"""The NF4 expert loop's time per MoE layer on the CPU, before and after issue 32 point 7.

    python benchmarks/nf4_experts.py [--hidden 512] [--width 192] [--experts 128] [--top-k 8]
                                     [--tokens 256 2048] [--bf16] [--repeats 15] [--threads 1]

One Qwen3-MoE-like experts module (transformers' ``Qwen3MoeExperts``: gate_up ``[E, 2w, h]``,
down ``[E, h, w]``; Qwen3-30B-A3B is h 2048, w 768, 128 experts, top-8, scaled down by default
so that a layer runs in well under a second), its experts quantized by
`homelab_dp.nf4_quantization.quantize_experts`, routed by a random router (softmax top-k).

"before" is the loop as it was (kept below: one expert dequantized per bitsandbytes call, its
rows sliced in Python, again in backward); "after" is
`homelab_dp.nf4_quantization.nf4_experts_forward` (routed experts dequantized a group at a
time, one gather of the rows, the biases one gather). Both run the same inputs; the script
checks that their outputs are equal and their input gradients equal up to the order of a
sum before timing. Times are CPU time
(``time.process_time``, less disturbed by other processes than wall time on a shared machine)
per layer: the median of ``--repeats`` interleaved runs (before, after, before, ...), on
``--threads`` threads (one by default: CPU time of several threads on a shared machine mostly
measures their contention).
"forward" runs under ``torch.no_grad``; "fwd+bwd" is a forward and a backward to the input.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from homelab_dp.nf4_quantization import dequantize_expert, nf4_experts_forward, quantize_experts


class _OldExpertLinear(torch.autograd.Function):
    """The loop before issue 32 point 7: one expert dequantized per call, again in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: nn.Module, name: str, expert: int, t: bool):  # noqa: ANN205
        ctx.module, ctx.name, ctx.expert, ctx.transposed = module, name, expert, t
        w = dequantize_expert(module, name, expert)
        return x @ w if t else x @ w.t()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # noqa: ANN205
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        w = dequantize_expert(ctx.module, ctx.name, ctx.expert)
        return (grad @ w.t() if ctx.transposed else grad @ w), None, None, None, None


def _old_linear(module: nn.Module, name: str, expert: int, x: torch.Tensor) -> torch.Tensor:
    out = _OldExpertLinear.apply(x, module, name, expert, module.is_transposed)
    if module.has_bias:
        out = out + module.get_parameter(f"{name}_bias")[expert]
    return out


def old_forward(
    self: nn.Module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """`nf4_experts_forward` as it was before issue 32 point 7 (commit 28afaeb)."""
    num_tokens, hidden_dim = hidden.shape
    num_top_k = top_k_index.size(-1)
    compute = self.nf4_compute_dtype
    x = hidden.to(compute)
    sorted_ids, perm = torch.sort(top_k_index.reshape(-1), stable=True)
    counts = torch.bincount(sorted_ids, minlength=self.num_experts).tolist()
    first = "gate_up_proj" if self.has_gate else "up_proj"
    outs, start = [], 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        rows = perm[start : start + n]
        start += n
        if e >= self.num_experts:
            outs.append(x.new_zeros(n, hidden_dim))
            continue
        h = _old_linear(self, first, e, x[rows // num_top_k])
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        h = _old_linear(self, "down_proj", e, h)
        outs.append(h)
    grouped = torch.cat(outs) * top_k_weights.reshape(-1)[perm].unsqueeze(-1).to(compute)
    inv_perm = torch.empty_like(perm)
    inv_perm[perm] = torch.arange(perm.numel(), device=perm.device)
    return grouped[inv_perm].view(num_tokens, num_top_k, hidden_dim).sum(dim=1).to(hidden.dtype)


Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _experts(args: argparse.Namespace, dtype: torch.dtype) -> nn.Module:
    config = Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.width,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    torch.manual_seed(0)
    holder = nn.Module()
    holder.experts = Qwen3MoeExperts(config).to(dtype)
    with torch.no_grad():
        for p in holder.experts.parameters():
            p.normal_(0, 0.02)
    quantize_experts(holder, dtype)
    return holder.experts


def _inputs(args: argparse.Namespace, tokens: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(tokens, args.hidden, generator=g).to(dtype)
    logits = torch.randn(tokens, args.experts, generator=g)
    weights, index = torch.softmax(logits, -1).topk(args.top_k, dim=-1)
    return hidden, index, (weights / weights.sum(-1, keepdim=True)).to(dtype)


def _run(
    fn: Forward, experts: nn.Module, inputs: tuple[torch.Tensor, ...], backward: bool
) -> float:
    hidden, index, weights = inputs
    start = time.process_time()
    if backward:
        x = hidden.detach().requires_grad_()
        fn(experts, x, index, weights).float().square().sum().backward()
    else:
        with torch.no_grad():
            fn(experts, hidden, index, weights)
    return time.process_time() - start


def _check(experts: nn.Module, inputs: tuple[torch.Tensor, ...]) -> None:
    hidden, index, weights = inputs
    grads, outs = [], []
    for fn in (old_forward, nf4_experts_forward):
        x = hidden.detach().requires_grad_()
        out = fn(experts, x, index, weights)
        out.float().square().sum().backward()
        outs.append(out.detach())
        grads.append(x.grad)
    # The forward is bit for bit the same; the input gradient sums each token's top-k
    # contributions in another order (one gather's backward instead of one per expert): equal
    # up to a few roundings of the dtype, relative to the largest gradient.
    bound = 4 * torch.finfo(grads[0].dtype).eps * grads[0].abs().max()
    if not torch.equal(outs[0], outs[1]) or (grads[0] - grads[1]).abs().max() > bound:
        raise SystemExit("before and after differ: not timing a changed result")


def main() -> None:
    """Print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--width", type=int, default=192)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    experts = _experts(args, dtype)
    print(
        f"h {args.hidden}, w {args.width}, {args.experts} experts, top-{args.top_k}, "
        f"{str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, "
        f"median of {args.repeats} interleaved runs, CPU ms per layer"
    )
    print(f"{'tokens':>6} {'pass':>8} {'before':>9} {'after':>9} {'speed-up':>9}")
    for tokens in args.tokens:
        inputs = _inputs(args, tokens, dtype)
        _check(experts, inputs)
        for backward in (False, True):
            times: dict[str, list[float]] = {"before": [], "after": []}
            for fn in (old_forward, nf4_experts_forward):  # warm-up
                _run(fn, experts, inputs, backward)
            for _ in range(args.repeats):
                times["before"].append(_run(old_forward, experts, inputs, backward))
                times["after"].append(_run(nf4_experts_forward, experts, inputs, backward))
            before, after = (1e3 * statistics.median(times[k]) for k in ("before", "after"))
            label = "fwd+bwd" if backward else "forward"
            print(f"{tokens:>6} {label:>8} {before:>9.1f} {after:>9.1f} {before / after:>8.2f}x")


if __name__ == "__main__":
    main()
