#!/usr/bin/env python
"""Pairs per second of vlfuse.Predictor on CPU: batch sizes x image cache on/off x torch threads.

The workload is easy-VQA test images with several questions each (10 by default), image after
image, as an application asking many questions about each picture would send them. Each case is a
whole ``Predictor.predict`` call over the workload, from image files to answers (loading and
preprocessing included). Cases run round-robin: each repetition runs every case once, starting
one case later than the previous repetition, so that load from other processes hits all cases
alike. Speeds come from median times; ratios are medians of the per-repetition ratios, which are
steadier than ratios of medians on a shared machine.

``--threads 1 2`` compares thread counts (each case sets its own, through ``Predictor(threads=)``);
``--busy N`` runs N busy-looping processes for the whole measurement: a machine loaded by others,
side by side with the same command at ``--busy 0``.

Without ``--model`` the default architecture of configs/easy_vqa.yaml is built untrained (speed
does not depend on the weights), with easy-VQA's answers and a tokenizer from its questions.

Example:
    .venv/bin/python scripts/bench_predict.py
    .venv/bin/python scripts/bench_predict.py --model runs/easy_vqa/latest/model --batch-sizes 1 16 64
    .venv/bin/python scripts/bench_predict.py --batch-sizes 64 --threads 1 2 --busy 2
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import warnings
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import torch
from _common import (
    DEFAULT_CONFIG,
    add_model_argument,
    add_timing_arguments,
    saved_or_untrained_model,
)

from vlfuse.analysis.tables import markdown_table
from vlfuse.analysis.timing import Timings, time_interleaved
from vlfuse.inference import PredictWarning, Predictor
from vlfuse.runtime import DEFAULT_THREADS


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("Example:")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser, required=False, help="saved model directory (default: the config's, untrained)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="config whose model.architecture to build when --model is not given")
    parser.add_argument("--images", type=int, default=16, help="distinct images in the workload (default 16)")
    parser.add_argument("--questions-per-image", type=int, default=10, help="questions per image (default 10)")
    parser.add_argument(
        "--batch-sizes", type=int, nargs="+", default=[1, 64], help="Predictor batch sizes (default 1 64)"
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[DEFAULT_THREADS], metavar="N",
                        help=f"torch CPU thread counts to compare (default {DEFAULT_THREADS})")
    parser.add_argument("--busy", type=int, default=0, metavar="N",
                        help="busy-looping processes to run meanwhile: a loaded machine (default 0)")
    add_timing_arguments(parser, repeats=10, warmup=1)
    args = parser.parse_args(argv)
    if min(args.threads) < 1 or args.busy < 0:
        parser.error(f"--threads must be at least 1 and --busy at least 0, got {args.threads} and {args.busy}")
    return args


@contextmanager
def busy_processes(count: int) -> Iterator[None]:
    """Run ``count`` processes that spin on a core each, for the duration of the block."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def workload(n_images: int, per_image: int) -> tuple[list[str], list[str]]:
    """easy-VQA test images with at least ``per_image`` questions: (paths, questions), image after image."""
    import easy_vqa

    questions, _, image_ids = easy_vqa.get_test_questions()
    paths = easy_vqa.get_test_image_paths()
    by_image: dict[int, list[str]] = defaultdict(list)
    for question, image_id in zip(questions, image_ids):
        by_image[image_id].append(question)
    chosen = [i for i in sorted(by_image) if len(by_image[i]) >= per_image][:n_images]
    if len(chosen) < n_images:
        raise SystemExit(f"easy-VQA has only {len(chosen)} test images with {per_image} questions")
    pairs = [(paths[i], q) for i in chosen for q in by_image[i][:per_image]]
    return [p for p, _ in pairs], [q for _, q in pairs]


def time_predictors(predictors: dict, paths, questions, repeats: int, warmup: int) -> tuple[Timings, dict]:
    """Seconds per ``predict`` call for each case, side by side; and each case's answers."""
    answers: dict = {}

    def ask(case):
        def run() -> None:
            answers[case] = [r["answer"] for r in predictors[case].predict(paths, questions)]

        return run

    return time_interleaved({case: ask(case) for case in predictors}, repeats, warmup), answers


def results_table(timings: Timings, batch_sizes: list[int], threads: list[int], n_pairs: int) -> str:
    """Rows per (batch size, cache, threads): speed, the cache's speed-up, the speed-up versus batch 1
    without cache, and the time with ``threads[0]`` threads over this case's time (>1: this count is faster)."""
    baseline = (batch_sizes[0], False, threads[0])
    rows = []
    for batch_size in batch_sizes:
        for cache in (True, False):
            for count in threads:
                case = (batch_size, cache, count)
                seconds = timings.median(case)
                rows.append([
                    batch_size, "on" if cache else "off", count, n_pairs / seconds, 1000 * seconds / n_pairs,
                    timings.ratio((batch_size, False, count), case), timings.ratio(baseline, case),
                    timings.ratio((batch_size, cache, threads[0]), case),
                ])
    header = ["batch size", "image cache", "threads", "pairs/s", "ms/pair", "cache speed-up",
              f"vs batch {batch_sizes[0]}, no cache, {threads[0]} thread(s)", f"vs {threads[0]} thread(s)"]
    return markdown_table(header, rows, formats=[None, None, None, "{:.1f}", "{:.2f}", "{:.2f}x", "{:.2f}x", "{:.2f}x"])


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark, print the table; return ``{(batch size, cache, threads): [seconds per call]}``."""
    args = parse_args(argv)
    model = saved_or_untrained_model(args.model, args.config)
    paths, questions = workload(args.images, args.questions_per_image)
    predictors = {
        (batch_size, cache, count): Predictor(model, batch_size=batch_size, cache_images=cache, threads=count)
        for batch_size in args.batch_sizes
        for cache in (True, False)
        for count in args.threads
    }
    with warnings.catch_warnings(), busy_processes(args.busy):
        warnings.simplefilter("ignore", PredictWarning)  # a model trained elsewhere may not know easy-VQA's words
        load = os.getloadavg()[0]
        timings, answers = time_predictors(predictors, paths, questions, args.repeats, args.warmup)
    same = len({tuple(a) for a in answers.values()}) == 1
    config = model.config
    print(
        f"Predictor on {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{os.cpu_count()} cores, load average {load:.1f} at the start, {args.busy} busy processes added; "
        f"model: {args.model or 'untrained ' + args.config.name} "
        f"(image {config.image.image_size}px, {model.image_encoder.grid_size} patches, fuser {config.fuser.type} with "
        f"{model.num_fusion_layers}x{model.num_heads_built} heads, dim {config.fusion_dim})"
    )
    print(
        f"workload: {args.images} easy-VQA test images x {args.questions_per_image} questions = {len(paths)} pairs; "
        f"median of {args.repeats} round-robin repetitions (after {args.warmup} warm-up)\n"
    )
    print(results_table(timings, args.batch_sizes, args.threads, len(paths)))
    print(f"\nanswers identical in every case: {'yes' if same else 'NO'}")
    return timings.samples


if __name__ == "__main__":
    main()
