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
    .venv/bin/python scripts/bench_pruning.py --config configs/easy_vqa.yaml --model runs/easy_vqa/model --threads 2
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from vlfuse.analysis.data import build_datamodule, load_batches, read_config
from vlfuse.analysis.head_scores import weight_norm_scores
from vlfuse.analysis.pruning import (
    heads_per_layer,
    heads_to_prune,
    measure_latency,
    prune_model,
    speedup,
    take_questions,
)
from vlfuse.model import VLFuseConfig, VLFuseModel

REPO = Path(__file__).resolve().parents[1]
TARGET_FRACTION, TARGET_SPEEDUP = 0.5, 1.6


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("Example:")[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "easy_vqa.yaml",
                        help="config whose data (and, without --model, architecture) to use")
    parser.add_argument("--model", type=Path, help="saved model directory (default: the config's, untrained)")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.25, 0.5, 0.75],
                        help="shares of the heads to prune (default 0.25 0.5 0.75)")
    parser.add_argument("--questions", type=int, default=64, help="questions per forward pass (default 64)")
    parser.add_argument("--repeats", type=int, default=30, help="timed repetitions (default 30)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed repetitions first (default 3)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (default: torch's choice)")
    return parser.parse_args(argv)


def load_model(model_dir: Path | None, config: dict, datamodule) -> VLFuseModel:
    """A saved model, or the config's architecture untrained with its data's answers and questions."""
    if model_dir is not None:
        return VLFuseModel.from_pretrained(model_dir)
    torch.manual_seed(0)
    architecture = VLFuseConfig.from_dict(config["model"]["architecture"])
    return VLFuseModel.from_config(architecture, datamodule.answers, datamodule.train_questions)


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark and print the table; return ``{name: Latency}``."""
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    # At least one question per image, so args.questions images are enough.
    datamodule = build_datamodule(args.config, [f"--data.init_args.limit_images={args.questions}"])
    model = load_model(args.model, read_config(args.config), datamodule).eval()
    batch = take_questions(load_batches(datamodule, model, "val"), args.questions)

    scores = weight_norm_scores(model)
    models = {"unpruned": model}
    for fraction in args.fractions:
        models[f"{fraction:.0%} pruned"] = prune_model(model, heads_to_prune(scores, fraction=fraction))
    latency = measure_latency(models, batch, repeats=args.repeats, warmup=args.warmup)

    print(f"torch {torch.__version__}, CPU, {torch.get_num_threads()} threads; {len(batch['questions'])} questions "
          f"about {len(batch['pixel_values'])} images; medians of {args.repeats} side-by-side repetitions\n")
    print("| model | heads per layer | fusion stack ms | fusion speed-up | whole model ms | whole speed-up |")
    print("|:---|:---|---:|---:|---:|---:|")
    ratios = {}
    for name, pruned in models.items():
        ratios[name] = speedup(latency["unpruned"], latency[name])
        heads = ", ".join(map(str, heads_per_layer(pruned)))
        t = latency[name]
        print(f"| {name} | {heads} | {t.fusion * 1e3:.2f} | {ratios[name][0]:.2f}x | "
              f"{t.model * 1e3:.2f} | {ratios[name][1]:.2f}x |")
    target = f"{TARGET_FRACTION:.0%} pruned"
    if target in ratios:
        measured = ratios[target][0]
        verdict = "PASS" if measured >= TARGET_SPEEDUP else "FAIL"
        print(f"\nTarget (benchmark goal, not an assertion):\n  {verdict}  fusion stack >= {TARGET_SPEEDUP}x faster "
              f"at {target}  (measured {measured:.2f})")
    return latency


if __name__ == "__main__":
    main()
