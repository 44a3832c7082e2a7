#!/usr/bin/env python
"""Benchmark vlfuse's CrossAttention against other ways of writing the same block (CPU, fp32).

Contenders, all text->image cross-attention (queries: text tokens, keys/values: image tokens):

    a     vlfuse.CrossAttention (fused key/value projection, SDPA core)
    b     the textbook block: separate q/k/v nn.Linear, view, transpose, matmul, softmax, matmul
    c     nn.MultiheadAttention(batch_first=True), called with need_weights=False
    d12   CrossAttention physically pruned to 12 heads (prune_heads)
    d8    CrossAttention physically pruned to 8 heads
    bare  one bare matrix product (B*Lk, D) @ (D, 2D): the work of the fused key/value projection

Every (contender, Lk, forward | forward+backward) case is timed round-robin: each repetition runs
every case once, starting one case later than the previous repetition, so that noise from other
processes hits all cases alike. The cases of one (Lk, mode) run next to each other, so a contender
and (a) are timed seconds apart. Median times are reported, with ratios to (a) (time_x / time_a,
so a ratio above 1 means (a) is faster) and the achieved FLOP/s as a fraction of the bare
product's. Ratios are medians of the per-repetition ratios: on a shared CPU whose load changes from
second to second they are steadier than the ratio of two medians.

The targets printed at the end are benchmark goals, not assertions: the exit status is 0 either way.

Example:
    python scripts/bench_attention.py --lk 197 577 --json runs/bench_attention.json
    python scripts/bench_attention.py --lk 197 577 --baseline runs/bench_attention_before.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from vlfuse import CrossAttention
from vlfuse.analysis import tables, timing

FWD, FWD_BWD = "fwd", "fwd+bwd"
LABELS = {
    "a": "(a) CrossAttention (SDPA)",
    "b": "(b) textbook q/k/v block",
    "c": "(c) nn.MultiheadAttention",
    "bare": "bare (B*Lk,D)@(D,2D) product",
}
QUICK = {"batch": 2, "lq": 4, "dim": 64, "heads": 16, "lk": [8, 16], "repeats": 3, "warmup": 1}


class TextbookCrossAttention(nn.Module):
    """Cross-attention as written in the textbook: one Linear each for q, k and v, explicit softmax."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        b, length, _ = t.shape
        return t.view(b, length, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, hd)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        q, k, v = self._heads(self.q(x)), self._heads(self.k(context)), self._heads(self.v(context))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # (B, H, Lq, Lk)
        out = scores.softmax(dim=-1) @ v  # (B, H, Lq, hd)
        b, lq, dim = x.shape
        return self.out(out.transpose(1, 2).reshape(b, lq, dim))  # (B, Lq, D)

    @classmethod
    def from_cross_attention(cls, attn: CrossAttention) -> "TextbookCrossAttention":
        """The same function as ``attn`` (unpruned, with biases), with the k/v weights unfused."""
        new = cls(attn.dim, attn.num_heads)
        w_k, w_v = attn.kv_proj.weight.chunk(2)
        b_k, b_v = attn.kv_proj.bias.chunk(2)
        with torch.no_grad():
            for linear, weight, bias in (
                (new.q, attn.q_proj.weight, attn.q_proj.bias),
                (new.k, w_k, b_k),
                (new.v, w_v, b_v),
                (new.out, attn.out_proj.weight, attn.out_proj.bias),
            ):
                linear.weight.copy_(weight)
                linear.bias.copy_(bias)
        return new


class TorchCrossAttention(nn.Module):
    """``nn.MultiheadAttention`` called as cross-attention, with the same call signature as the others."""

    def __init__(self, mha: nn.MultiheadAttention) -> None:
        super().__init__()
        self.mha = mha

    @property
    def num_heads(self) -> int:
        return self.mha.num_heads

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return self.mha(x, context, context, need_weights=False)[0]


@dataclass
class Case:
    """One timed thing: a contender at one context length, forward only or forward+backward."""

    contender: str
    lk: int
    mode: str
    run: Callable[[], object]
    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)


@dataclass
class Target:
    """A benchmark goal: ``measured >= threshold`` (``measured`` is None when not measured)."""

    description: str
    measured: float | None
    threshold: float

    @property
    def status(self) -> str:
        if self.measured is None:
            return "SKIP"
        return "PASS" if self.measured >= self.threshold else "FAIL"


def build_contenders(dim: int, heads: int, prune_to: list[int]) -> dict[str, nn.Module]:
    """Contenders computing the same function (a, b, c share weights) and pruned copies of (a)."""
    mha = nn.MultiheadAttention(dim, heads, batch_first=True)
    attn = CrossAttention.from_torch(mha)
    contenders = {"a": attn, "b": TextbookCrossAttention.from_cross_attention(attn), "c": TorchCrossAttention(mha)}
    for keep in prune_to:
        pruned = copy.deepcopy(attn)
        pruned.prune_heads(range(keep, heads))
        contenders[f"d{keep}"] = pruned
    return {name: module.eval() for name, module in contenders.items()}


def check_same_function(contenders: dict[str, nn.Module], x: torch.Tensor, context: torch.Tensor) -> None:
    """Make sure (a), (b) and (c) compute the same output, so that the race is fair."""
    with torch.inference_mode():
        expected = contenders["a"](x, context)
        for name in ("b", "c"):
            torch.testing.assert_close(contenders[name](x, context), expected, atol=1e-4, rtol=1e-4)


def forward_only(module: nn.Module, x: torch.Tensor, context: torch.Tensor) -> Callable[[], object]:
    """A forward pass under inference mode."""

    def run() -> object:
        with torch.inference_mode():
            return module(x, context)

    return run


def forward_backward(module: nn.Module, x: torch.Tensor, context: torch.Tensor) -> Callable[[], object]:
    """Forward and backward, with gradients for the weights and for both inputs (as inside a model).

    Modules stay in eval mode: with no dropout, training mode computes the same thing.
    """
    x = x.clone().requires_grad_()
    context = context.clone().requires_grad_()
    grad_out = torch.randn_like(x)

    def run() -> object:
        module.zero_grad(set_to_none=True)
        x.grad = context.grad = None
        module(x, context).backward(grad_out)

    return run


def bare_product(batch: int, lk: int, dim: int) -> Callable[[], object]:
    """(B*Lk, D) @ (D, 2D), the weight stored (2D, D) and transposed, as nn.Linear stores it."""
    tokens = torch.randn(batch * lk, dim)
    weight_t = torch.randn(2 * dim, dim).t()

    def run() -> object:
        with torch.inference_mode():
            return tokens @ weight_t

    return run


def build_cases(contenders: dict[str, nn.Module], batch: int, lq: int, dim: int, lks: list[int]) -> list[Case]:
    """Every contender at every Lk, forward and forward+backward, plus the bare product per Lk.

    Ordered by (Lk, mode), so that the cases compared with each other run one after another.
    """
    cases = []
    for lk in lks:
        x, context = torch.randn(batch, lq, dim), torch.randn(batch, lk, dim)
        cases += [Case(name, lk, FWD, forward_only(module, x, context)) for name, module in contenders.items()]
        cases.append(Case("bare", lk, FWD, bare_product(batch, lk, dim)))
        cases += [Case(name, lk, FWD_BWD, forward_backward(module, x, context)) for name, module in contenders.items()]
    return cases


def measure(cases: list[Case], repeats: int, warmup: int) -> None:
    """Round-robin timing: each repetition runs every case once, starting one case further along."""
    samples = timing.time_interleaved({i: case.run for i, case in enumerate(cases)}, repeats, warmup).samples
    for i, case in enumerate(cases):
        case.samples += samples[i]


def block_flops(batch: int, lq: int, lk: int, dim: int, heads: int, head_dim: int) -> int:
    """Forward FLOPs of one block (2 per multiply-add): q, kv and out projections, QK^T and AV."""
    inner = heads * head_dim
    q_proj = 2 * batch * lq * dim * inner
    kv_proj = 2 * batch * lk * dim * 2 * inner
    core = 2 * (2 * batch * heads * lq * lk * head_dim)  # QK^T and AV
    out_proj = 2 * batch * lq * inner * dim
    return q_proj + kv_proj + core + out_proj


def paired_ratio(case: Case, reference: Case) -> float:
    """Median over repetitions of ``case``'s time / ``reference``'s time in the same repetition."""
    return timing.paired_ratio(case.samples, reference.samples)


def noise(cases: list[Case]) -> float:
    """Median over cases of the interquartile range of the samples, relative to their median."""
    spreads = []
    for case in cases:
        q1, _, q3 = statistics.quantiles(case.samples, n=4)
        spreads.append((q3 - q1) / case.median)
    return statistics.median(spreads)


def label(name: str) -> str:
    """Human-readable name of a contender key (``d8`` -> pruned to 8 heads)."""
    if name.startswith("d"):
        return f"(d) CrossAttention pruned to {name[1:]} heads"
    return LABELS[name]


def summarise(cases: list[Case], contenders: dict[str, nn.Module], args: argparse.Namespace) -> list[dict]:
    """One row per (Lk, contender): median times, ratios to (a), FLOP/s as a fraction of the bare product's.

    Forward+backward is counted as 3x the forward FLOPs (both inputs and all weights get gradients).
    """
    by_key = {(case.contender, case.lk, case.mode): case for case in cases}
    rows = []
    for lk in args.lk:
        bare = by_key["bare", lk, FWD]
        bare_flops = 2 * args.batch * lk * args.dim * 2 * args.dim
        for name in [*contenders, "bare"]:
            fwd = by_key[name, lk, FWD]
            row = {"contender": name, "label": label(name), "lk": lk, "fwd_ms": 1e3 * fwd.median,
                   "fwd_ratio": paired_ratio(fwd, by_key["a", lk, FWD]), "fwd_bwd_ms": None, "fwd_bwd_ratio": None,
                   "fwd_flops_fraction": 1.0, "fwd_bwd_flops_fraction": None}
            if name != "bare":
                fwd_bwd = by_key[name, lk, FWD_BWD]
                heads = contenders[name].num_heads
                relative_flops = block_flops(args.batch, args.lq, lk, args.dim, heads, args.dim // args.heads) / bare_flops
                row.update(fwd_bwd_ms=1e3 * fwd_bwd.median, fwd_bwd_ratio=paired_ratio(fwd_bwd, by_key["a", lk, FWD_BWD]),
                           fwd_flops_fraction=relative_flops / paired_ratio(fwd, bare),
                           fwd_bwd_flops_fraction=3 * relative_flops / paired_ratio(fwd_bwd, bare))
            rows.append(row)
    return rows


def markdown_table(rows: list[dict]) -> str:
    """The rows as a Markdown table, ready to paste into a README."""
    columns = {"lk": "Lk", "label": "contender", "fwd_ms": "fwd ms", "fwd_ratio": "fwd t/t(a)",
               "fwd_bwd_ms": "fwd+bwd ms", "fwd_bwd_ratio": "fwd+bwd t/t(a)",
               "fwd_flops_fraction": "fwd FLOP/s / bare", "fwd_bwd_flops_fraction": "fwd+bwd FLOP/s / bare"}
    formats = [None, None, "{:.1f}", "{:.2f}", "{:.1f}", "{:.2f}", "{:.0%}", "{:.0%}"]
    return tables.markdown_table(columns, rows, formats=formats)


def comparison_table(rows: list[dict], baseline: dict) -> str:
    """This run's median times and ratios to (a) next to those of an earlier run (its ``--json`` report).

    Run the benchmark once on an older commit with ``--json``, then here with ``--baseline``: a ratio
    t/t(a) that drops from before to now means (a) got slower relative to the others.
    """
    before = {(r["contender"], r["lk"]): r for r in baseline["rows"]}
    header = ["Lk", "contender", "fwd ms before", "fwd ms now", "fwd t/t(a) before", "fwd t/t(a) now",
              "fwd+bwd t/t(a) before", "fwd+bwd t/t(a) now"]
    table = []
    for r in rows:
        b = before.get((r["contender"], r["lk"]), {})
        table.append([r["lk"], r["label"], b.get("fwd_ms"), r["fwd_ms"], b.get("fwd_ratio"), r["fwd_ratio"],
                      b.get("fwd_bwd_ratio"), r["fwd_bwd_ratio"]])
    formats = [None, None, "{:.1f}", "{:.1f}", "{:.2f}", "{:.2f}", "{:.2f}", "{:.2f}"]
    return tables.markdown_table(header, table, formats=formats)


def check_targets(rows: list[dict], lks: list[int]) -> list[Target]:
    """The issue's targets, on forward times, at the longest Lk (577) and the shortest (197)."""
    ratio = {(r["contender"], r["lk"]): r["fwd_ratio"] for r in rows}  # time_x / time_a
    flops = {r["lk"]: r["fwd_flops_fraction"] for r in rows if r["contender"] == "a"}
    long, short = max(lks), min(lks)
    d8 = ratio.get(("d8", long))
    return [
        Target(f"Lk={long}: (a) >= 1.2x faster than (b), fwd", ratio["b", long], 1.2),
        Target(f"Lk={long}: (a) >= 1.3x faster than (c), fwd", ratio["c", long], 1.3),
        Target(f"Lk={short}: (a) no slower than (b), fwd", ratio["b", short], 1.0),
        Target(f"Lk={short}: (a) no slower than (c), fwd", ratio["c", short], 1.0),
        *(Target(f"Lk={lk}: (a) at >= 85% of the bare product's FLOP/s, fwd", flops[lk], 0.85)
          for lk in sorted({short, long})),
        Target(f"Lk={long}: 8 heads >= 1.7x faster than (a)'s 16, fwd", None if d8 is None else 1.0 / d8, 1.7),
    ]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lk", type=int, nargs="+", default=[197, 577], help="image token counts (keys/values)")
    parser.add_argument("--batch", type=int, default=32, help="batch size B")
    parser.add_argument("--lq", type=int, default=32, help="text token count Lq (queries)")
    parser.add_argument("--dim", type=int, default=768, help="model width D")
    parser.add_argument("--heads", type=int, default=16, help="attention heads H of the unpruned block")
    parser.add_argument("--prune-to", type=int, nargs="*", default=[12, 8], help="head counts of the pruned copies")
    parser.add_argument("--repeats", type=int, default=9, help="timed repetitions of every case")
    parser.add_argument("--warmup", type=int, default=1, help="untimed repetitions of every case first")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes and few repeats: a smoke test, not a benchmark")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    parser.add_argument("--baseline", type=Path, default=None, metavar="PATH",
                        help="the --json report of an earlier run (e.g. an older commit): print both side by side")
    parser.add_argument("--seed", type=int, default=0, help="seed for weights and inputs")
    args = parser.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> list[Target]:
    """Run the benchmark, print the table and the targets; return the targets."""
    args = parse_args(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    contenders = build_contenders(args.dim, args.heads, args.prune_to)
    check_same_function(contenders, torch.randn(2, args.lq, args.dim), torch.randn(2, min(args.lk), args.dim))
    cases = build_cases(contenders, args.batch, args.lq, args.dim, args.lk)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}; "
          f"B={args.batch} Lq={args.lq} D={args.dim} H={args.heads} Lk={args.lk}; "
          f"{len(cases)} cases x ({args.warmup} warm-up + {args.repeats} timed), round-robin", flush=True)
    started = time.perf_counter()
    measure(cases, args.repeats, args.warmup)
    print(f"measured in {time.perf_counter() - started:.0f} s; medians below\n")

    rows = summarise(cases, contenders, args)
    table = markdown_table(rows)
    print(table)
    print(f"\nRatios t/t(a) and FLOP/s fractions are medians of per-repetition ratios. Noise: the samples of "
          f"a case spread over a median interquartile range of {noise(cases):.0%} of their median.")
    for lk in args.lk:
        share = next(r["fwd_ratio"] for r in rows if r["contender"] == "bare" and r["lk"] == lk)
        print(f"Lk={lk}: the bare key/value product takes {share:.0%} of (a)'s forward time (paired median)")
    if args.baseline is not None:
        print(f"\nThis run next to {args.baseline}:\n")
        print(comparison_table(rows, json.loads(args.baseline.read_text())))
    targets = check_targets(rows, args.lk)
    print("\nTargets (benchmark goals, not assertions):")
    for t in targets:
        measured = "not measured" if t.measured is None else f"measured {t.measured:.2f}"
        print(f"  {t.status}  {t.description}  ({measured}, need >= {t.threshold:.2f})")

    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows, "table": table,
            "samples_ms": [{"contender": c.contender, "lk": c.lk, "mode": c.mode,
                            "ms": [1e3 * s for s in c.samples]} for c in cases],
            "targets": [{"description": t.description, "measured": t.measured, "threshold": t.threshold,
                         "status": t.status} for t in targets],
        }
        args.json.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json}")
    return targets


if __name__ == "__main__":
    main()
