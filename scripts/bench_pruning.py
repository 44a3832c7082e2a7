#!/usr/bin/env python
"""CPU latency of a model with 25, 50 and 75% of its fusion heads pruned, side by side.

The heads go by lowest weight norm, ranked over all layers (latency depends on how many heads are
left, not on which). Every model runs on the same batch of real questions (64 by default) with
their images, once per repetition, in a rotating order: (1) the fusion stack (keys/values of the
image tokens for every layer, then the fusion blocks, from encoder outputs computed beforehand)
and (2) the whole model, from pixels to answer scores. Times are medians; speed-ups are medians
of the per-repetition ratios to the unpruned model, which are steadier on a shared machine.

Without ``--model`` the config's architecture is built untrained (speed does not depend on the
weights), with the answers and questions of its data.

Example:
    .venv/bin/python scripts/bench_pruning.py --config configs/easy_vqa.yaml
    .venv/bin/python scripts/bench_pruning.py --config configs/easy_vqa.yaml --model runs/easy_vqa/latest/model --threads 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from _common import (
    DEFAULT_CONFIG,
    add_model_argument,
    add_threads_argument,
    add_timing_arguments,
    load_datamodule,
    saved_or_untrained_model,
    set_threads,
)

from vlfuse.analysis import pruning
from vlfuse.analysis.data import load_batches
from vlfuse.analysis.head_scores import weight_norm_scores
from vlfuse.analysis.tables import markdown_table

TARGET_FRACTION, TARGET_SPEEDUP = 0.5, 1.6


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("Example:")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="config whose data (and, without --model, architecture) to use")
    add_model_argument(parser, required=False, help="saved model directory (default: the config's, untrained)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75],
                        help="shares of the heads to prune (default 0.25 0.5 0.75)")
    parser.add_argument("--questions", type=int, default=64, help="questions per forward pass (default 64)")
    add_timing_arguments(parser, repeats=30, warmup=3)
    add_threads_argument(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark and print the table; return ``{name: Latency}``."""
    args = parse_args(argv)
    set_threads(args.threads)
    # At least one question per image, so args.questions images are enough.
    datamodule = load_datamodule(args.config, [f"--data.init_args.limit_images={args.questions}"])
    model = saved_or_untrained_model(args.model, args.config, datamodule)
    batch = pruning.take_questions(load_batches(datamodule, model, "val"), args.questions)

    scores = weight_norm_scores(model)
    models = {"unpruned": model}
    for fraction in args.fractions:
        models[f"{fraction:.0%} pruned"] = pruning.prune_model(model, pruning.heads_to_prune(scores, fraction=fraction))
    latency = pruning.measure_latency(models, batch, repeats=args.repeats, warmup=args.warmup)
    ratios = {name: pruning.speedup(latency["unpruned"], latency[name]) for name in models}

    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads; {len(batch['questions'])} questions "
          f"about {len(batch['pixel_values'])} images; medians of {args.repeats} side-by-side repetitions\n")
    rows = [
        [name, ", ".join(map(str, pruning.heads_per_layer(pruned))), latency[name].fusion * 1e3, ratios[name][0],
         latency[name].model * 1e3, ratios[name][1]]
        for name, pruned in models.items()
    ]
    header = ["model", "heads per layer", "fusion stack ms", "fusion speed-up", "whole model ms", "whole speed-up"]
    print(markdown_table(header, rows, formats=[None, None, "{:.2f}", "{:.2f}x", "{:.2f}", "{:.2f}x"]))
    target = f"{TARGET_FRACTION:.0%} pruned"
    if target in ratios:
        measured = ratios[target][0]
        verdict = "PASS" if measured >= TARGET_SPEEDUP else "FAIL"
        print(f"\nTarget (benchmark goal, not an assertion):\n  {verdict}  fusion stack >= {TARGET_SPEEDUP}x faster "
              f"at {target}  (measured {measured:.2f})")
    return latency


if __name__ == "__main__":
    main()
