#!/usr/bin/env python
"""How much of a CPU training step is the kernel faulting memory in, plain and checkpointed, side by side.

A plain training step at real size keeps about 4.9 GB of activations for backward (batch 32,
configs/base_224.yaml's preset). glibc's malloc serves blocks that large with ``mmap`` and hands them
back to the system when they are freed, so every step faults each page in again (and the kernel
zeroes it). Activation checkpointing keeps 14x less, which fits in memory malloc already holds. This
script times the forward+backward of both variants from the same weights, alternating, with the
minor page faults and the CPU seconds spent in the kernel of each (``getrusage``). Unlike
``scripts/bench_scale.py --parts checkpointing``, it never trims malloc's heap between steps, so the
allocator's own settings decide. Run it twice, as is and with malloc told to keep its memory::

    .venv/bin/python scripts/bench_page_faults.py --threads 2
    MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=100000000000 .venv/bin/python scripts/bench_page_faults.py --threads 2

(``MALLOC_MMAP_MAX_=0``: no block is served by ``mmap``; ``MALLOC_TRIM_THRESHOLD_``: freed memory at the
top of the heap stays with the process. glibc reads both when the process starts.)
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
from _common import add_threads_argument, set_threads
from bench_scale import PRESETS, Faults, build, loss_of, set_variant

from vlfuse.analysis.tables import markdown_table

VARIANTS = ("plain", "checkpointed")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="base", help="bench_scale.py's preset (default base: real size)")
    parser.add_argument("--batch", type=int, default=32, help="images per step, one question each (default 32)")
    parser.add_argument("--repeats", type=int, default=4, help="timed pairs, after one untimed pair (default 4)")
    add_threads_argument(parser)
    args = parser.parse_args(argv)
    if args.batch < 1 or args.repeats < 1:
        parser.error(f"--batch and --repeats must be at least 1, got {args.batch} and {args.repeats}")
    return args


def main(argv: list[str] | None = None) -> dict[str, list[tuple[float, Faults]]]:
    args = parse_args(argv)
    set_threads(args.threads)
    preset = PRESETS[args.preset]
    model, batch = build(preset, replace(preset.base, batch=args.batch), "plain", torch.device("cpu"))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # allocated once, as the optimizer keeps them
    measured: dict[str, list[tuple[float, Faults]]] = {v: [] for v in VARIANTS}
    for repetition in range(1 + args.repeats):
        for variant in VARIANTS if repetition % 2 == 0 else VARIANTS[::-1]:
            set_variant(model, variant)
            model.zero_grad(set_to_none=False)
            torch.manual_seed(1)  # the same dropout masks in both
            before, start = Faults.now(), time.perf_counter()
            loss_of(model, batch).backward()
            seconds, faults = time.perf_counter() - start, Faults.now() - before
            if repetition > 0:
                measured[variant].append((seconds, faults))
    ratios = [c[0] / p[0] for p, c in zip(measured["plain"], measured["checkpointed"])]
    rows = [[variant, statistics.median(s for s, _ in runs), max(s for s, _ in runs),
             statistics.median(f.minor for _, f in runs), statistics.median(f.kernel_s for _, f in runs)]
            for variant, runs in measured.items()]
    print(f"forward+backward, preset {args.preset}, batch {args.batch}, {torch.get_num_threads()} threads, "
          f"1 untimed + {args.repeats} timed pairs:\n")
    print(markdown_table(["variant", "s (median)", "s (worst)", "minor page faults (median)", "CPU s in the kernel (median)"], rows,
                         formats=[None, "{:.2f}", "{:.2f}", "{:,.0f}", "{:.1f}"]))
    print(f"\ncheckpointed / plain, each pair: {', '.join(f'{r:.2f}x' for r in ratios)} (median {statistics.median(ratios):.2f}x)")
    return measured


if __name__ == "__main__":
    main()
