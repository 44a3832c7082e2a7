#!/usr/bin/env python
"""Benchmark dense against local self-attention layers on long inputs (CPU, fp32, forward, batch 1).

Contenders at each token count L, whole layers (projections, attention, output projection) with
the same weights, H heads of 64 dims, called on one sequence x of L tokens in inference mode:

    dense             vlfuse.CrossAttention as self-attention, attn(x, x): every pair, SDPA (the baseline)
    <layout> mask     vlfuse.layers.LocalSelfAttention with use_flex=False: SDPA with the layout's
                      dense (L, L) bool mask, the local result at the dense cost
    <layout> flex     LocalSelfAttention with use_flex=True: compiled FlexAttention with the
                      layout's BlockMask, 128x128 tiles in which no pair may attend are skipped

Layouts (vlfuse.layers.local_attention): a sliding window of +-128 tokens; a 2-D neighbourhood of
radius 3 (7x7 patches) on a square patch grid after one global CLS token (so L = 1 + side^2 is the
square nearest the asked length); block-sparse with 128-token blocks, +-1 neighbour block and one
global block.

Time: every case of one L is timed round-robin (each repetition starts one case later), after one
untimed call (which compiles FlexAttention); medians are printed, with the median of per-repetition
ratios to ``dense``. Masks are built once per layout, before timing (their build time is printed
apart: they are cached by the layout).

Peak memory: for each case, a fresh worker process (glibc ``MALLOC_MMAP_THRESHOLD_=65536``, so every
buffer of 64 KiB or more is mapped on allocation and unmapped on free) makes one untimed call, then
resets the kernel's peak-RSS mark (``/proc/self/clear_refs``) and makes one more: the figure is the
peak resident memory during that call minus the resident memory just before it. It includes the
output and the projections (a few L x H x 64 x 4 bytes) and any mask conversion SDPA does inside
the call, not the inputs, the weights or the cached masks.

Linux only (``/proc``). The exit status is 0; nothing is asserted about times.

Example:
    python scripts/bench_local_attention.py --tokens 1024 4096 16384 --json runs/bench_local_attention.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from vlfuse.analysis import tables, timing
from vlfuse.layers import CrossAttention, LocalSelfAttention
from vlfuse.layers.local_attention import (
    LocalLayout,
    block_sparse,
    flex_unsupported_reason,
    grid_neighbourhood,
    sliding_window,
)

HEAD_DIM = 64
QUICK = {"tokens": [256, 512], "heads": 2, "repeats": 2}


def layouts(length: int) -> list[LocalLayout]:
    """The local layouts compared at about ``length`` tokens."""
    side = max(1, round(math.sqrt(length - 1)))
    return [
        sliding_window(length, 128),
        grid_neighbourhood(side, side, 3, num_prefix_tokens=1),
        block_sparse(length, 128, neighbours=1, global_blocks=1),
    ]


@dataclass
class Case:
    """One contender at one length, with its timings."""

    length: int
    name: str
    run: Callable[[], torch.Tensor]
    pairs_kept: float = 1.0
    tiles_kept: float | None = None
    ms: list[float] = field(default_factory=list)


def build_cases(length: int, heads: int, flex: bool, only: str | None = None) -> tuple[list[Case], dict[str, float]]:
    """The cases at ``length`` (all, or the one named ``only``) and the build time of their masks, in s."""
    g = torch.Generator().manual_seed(length)
    dim = heads * HEAD_DIM
    torch.manual_seed(length)
    full = CrossAttention(dim, heads).eval()
    cases, build_s = [], {}

    def wanted(name: str) -> bool:
        return only is None or only == name

    def local(layout: LocalLayout, use_flex: bool) -> LocalSelfAttention:
        attn = LocalSelfAttention(dim, heads, layout=layout).eval()
        attn.load_state_dict(full.state_dict())  # the same weights as the dense layer
        attn.use_flex = use_flex
        return attn

    x = torch.randn(1, length, dim, generator=g)  # (1, L, H * hd)
    if wanted("dense"):
        cases.append(Case(length, "dense", lambda: full(x, x)))
    for layout in layouts(length):
        tokens = x if layout.length == length else torch.randn(1, layout.length, dim, generator=g)
        start = time.perf_counter()
        kept = layout.dense().sum().item() / layout.length**2  # the dense mask is cached by the layout
        build_s[f"{layout.name} dense mask"] = time.perf_counter() - start
        if wanted(f"{layout.name}: mask"):
            cases.append(Case(length, f"{layout.name}: mask", functools.partial(local(layout, False), tokens), kept))
        if flex and wanted(f"{layout.name}: flex"):
            start = time.perf_counter()
            block_mask = layout.block_mask()
            build_s[f"{layout.name} block mask"] = time.perf_counter() - start
            run = functools.partial(local(layout, True), tokens)
            cases.append(Case(length, f"{layout.name}: flex", run, kept, 1.0 - block_mask.sparsity() / 100.0))
    return cases, build_s


def warm_up_and_check(cases: list[Case]) -> None:
    """One untimed call of every case (compiling FlexAttention); each layout's flex and dense-mask
    outputs must agree, or the comparison would be meaningless."""
    outputs = {case.name: case.run() for case in cases}
    for name, out in outputs.items():
        if name.endswith(": flex"):
            torch.testing.assert_close(out, outputs[name.replace(": flex", ": mask")], atol=1e-4, rtol=1e-4)


def measure_times(cases: list[Case], repeats: int) -> None:
    samples = timing.time_interleaved({i: case.run for i, case in enumerate(cases)}, repeats).samples
    for i, case in enumerate(cases):
        case.ms += [seconds * 1e3 for seconds in samples[i]]


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def peak_extra_bytes(run: Callable[[], torch.Tensor]) -> int:
    """Peak resident memory during ``run()`` minus the resident memory just before (see the module)."""
    run()
    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # reset the peak-RSS mark (VmHWM) to the current RSS
    before = _status_bytes("VmRSS")
    out = run()
    peak = _status_bytes("VmHWM")
    del out
    return peak - before


def memory_worker(length: int, heads: int, case_name: str) -> None:
    """Print the peak extra bytes of one case as JSON (run in a fresh process by :func:`measure_memory`)."""
    (case,), _ = build_cases(length, heads, flex=case_name.endswith(": flex"), only=case_name)
    with torch.inference_mode():
        print(json.dumps({"peak_extra_bytes": peak_extra_bytes(case.run)}))


def measure_memory(case: Case, heads: int, threads: int | None) -> int:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    command = [sys.executable, __file__, "--memory-worker", str(case.length), str(heads), case.name]
    command += ["--threads", str(threads)] if threads else []
    result = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"memory worker for {case.name} at {case.length} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])["peak_extra_bytes"]


def paired_ratio(case: Case, reference: Case) -> float:
    """Median over repetitions of time(case) / time(reference)."""
    return timing.paired_ratio(case.ms, reference.ms)


def summarise(cases: list[Case], memory: dict[tuple[int, str], int]) -> list[dict]:
    rows = []
    for case in cases:
        dense = next(c for c in cases if c.length == case.length and c.name == "dense")
        rows.append(
            {
                "tokens": case.length,
                "case": case.name,
                "pairs_kept": case.pairs_kept,
                "tiles_kept": case.tiles_kept,
                "ms": statistics.median(case.ms),
                "vs_dense": paired_ratio(case, dense),
                "peak_mib": memory[(case.length, case.name)] / 2**20 if (case.length, case.name) in memory else None,
            }
        )
    return rows


def markdown_table(rows: list[dict]) -> str:
    columns = {"tokens": "tokens", "case": "contender", "pairs_kept": "pairs kept", "tiles_kept": "tiles computed",
               "ms": "ms (median)", "vs_dense": "time / dense", "peak_mib": "peak extra MiB"}
    return tables.markdown_table(columns, rows, formats=[None, None, "{:.1%}", "{:.1%}", "{:.1f}", "{:.2f}", "{:.1f}"])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096, 16384], help="sequence lengths L")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (of 64 dims each)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions of every case")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-flex", action="store_true", help="leave FlexAttention out (dense masks only)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory workers")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows and raw timings here")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 2 heads, 2 repeats: a smoke test")
    parser.add_argument("--memory-worker", nargs=3, metavar=("L", "HEADS", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.heads, args.repeats = QUICK["tokens"], QUICK["heads"], QUICK["repeats"]
    if min(args.tokens) < 2 or args.heads < 1 or args.repeats < 1:
        parser.error("--tokens must be >= 2, --heads and --repeats >= 1")
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the benchmark, print the table; returns its rows."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # Every (layout, length) is its own compiled kernel: allow more than dynamo's default 8.
    torch._dynamo.config.recompile_limit = 64
    if args.memory_worker:
        length, heads, name = args.memory_worker
        memory_worker(int(length), int(heads), name)
        return []
    probe = torch.zeros(1, 1, 2, HEAD_DIM)
    reason = "--no-flex" if args.no_flex else flex_unsupported_reason(probe)
    flex = reason is None
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, batch 1, {args.heads} heads x "
        f"{HEAD_DIM}, forward in inference mode, {args.repeats} repeats"
        + ("" if flex else f"; no FlexAttention: {reason}")
    )
    all_cases, memory, builds = [], {}, {}
    for length in args.tokens:
        cases, build_s = build_cases(length, args.heads, flex)
        builds[length] = build_s
        with torch.inference_mode():
            warm_up_and_check(cases)
            measure_times(cases, args.repeats)
        if not args.no_memory:
            for case in cases:
                memory[(case.length, case.name)] = measure_memory(case, args.heads, args.threads)
        all_cases += cases
        print(f"  L={length}: done; mask build s: " + ", ".join(f"{k} {v:.2f}" for k, v in build_s.items()), flush=True)
    rows = summarise(all_cases, memory)
    print(markdown_table(rows))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        samples = [{"tokens": c.length, "case": c.name, "ms": c.ms} for c in all_cases]
        args.json.write_text(json.dumps({"rows": rows, "samples_ms": samples, "mask_build_s": builds}, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
