"""``vlfuse analyze``: what each fusion head does and which heads matter, as a markdown report.

    vlfuse analyze --model runs/easy_vqa/model --config configs/easy_vqa.yaml --out reports/easy_vqa

The data come from the ``data:`` section of a ``vlfuse fit`` config (any option can be overridden
as in ``vlfuse fit``: ``--data.init_args.limit_images 64``); labels are read against the model's own
answer vocabulary, so the training split is never loaded for it.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Sequence


from vlfuse.analysis.collect import collect_head_stats
from vlfuse.analysis.data import add_data_arguments, build_datamodule, load_batches, parse_with_data_overrides
from vlfuse.analysis.head_scores import evaluate, original_head_count, pruning_curve, score_heads
from vlfuse.analysis.report import write_report
from vlfuse.cli import SUBCOMMANDS
from vlfuse.model import VLFuseModel
from vlfuse.runtime import add_device_argument, add_threads_argument, set_threads

DEFAULT_FRACTIONS = tuple(round(0.1 * i, 1) for i in range(10))
REPORTED_SCORES = {"weight norm": "weight_norm", "weight norm s_i": "weight_norm_mean", "gradient": "gradient", "ablation": "ablation"}
"""The scores in the report: ``{title: name in HEAD_SCORES}``."""
SCORE_NOTES = {
    "weight norm": "||W_i^Q[l]||_F, the Frobenius norm of head i's rows of the query projection of its own "
    "layer l (head i of one layer and head i of another are unrelated heads).",
    "weight norm s_i": "s_i = (1/L) sum_l ||W_i^Q[l]||_F, the mean over the layers for head index i: the same "
    "value for head i in every layer.",
    "gradient": "Michel et al. (2019): the mean over questions of |dLoss/dg_i| for a gate g_i = 1 on the head's "
    "output (cross-entropy with the gold answer), each layer's scores divided by their L2 norm.",
    "ablation": "the accuracy lost when this head alone is removed (0.01 = one point; negative when the "
    "accuracy rises).",
}


def analyze(
    model: VLFuseModel,
    batches: list[dict],
    out_dir: str | Path,
    *,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    context: dict[str, str] | None = None,
) -> Path:
    """Collect head statistics, score the heads, draw the pruning curves and write the report.

    Returns:
        The path of ``report.md``.
    """
    collection = collect_head_stats(model, batches)
    scores = {title: score_heads(model, name, batches) for title, name in REPORTED_SCORES.items()}
    curves = {name: pruning_curve(model, score, batches, fractions) for name, score in scores.items()}
    return write_report(
        out_dir,
        collection,
        num_heads=original_head_count(model),
        scores=scores,
        curves=curves,
        accuracy=evaluate(model, batches),
        context=context or {},
        score_notes=SCORE_NOTES,
    )


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``vlfuse analyze``."""
    parser = argparse.ArgumentParser(
        prog="vlfuse analyze",
        description=SUBCOMMANDS["analyze"].description,
    )
    parser.add_argument("--model", required=True, help="a directory written by save_pretrained")
    parser.add_argument("--config", required=True, help="a vlfuse fit config; its data: section gives the data")
    parser.add_argument("--out", required=True, help="the report folder (created)")
    parser.add_argument(
        "--fractions", type=float, nargs="+", default=list(DEFAULT_FRACTIONS),
        help="fractions of heads to prune for the accuracy curves (default: 0 0.1 ... 0.9)",
    )
    add_device_argument(parser)
    add_threads_argument(parser)
    add_data_arguments(parser, split_help="the split to analyse (default: val)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``vlfuse analyze``: returns the exit status (user errors are raised as ``ValueError``)."""
    parser = build_parser()
    args, overrides = parse_with_data_overrides(parser, argv)
    if any(not 0.0 <= f < 1.0 for f in args.fractions):
        parser.error(f"--fractions must be in [0, 1), got {args.fractions}")
    set_threads(args.threads)
    device = args.device
    datamodule = build_datamodule(args.config, overrides)
    model = VLFuseModel.from_pretrained(args.model, map_location=device)
    model.require_fusion_heads("analyse", name=str(args.model))
    batches = load_batches(datamodule, model, args.split, args.max_batches)
    context = {"model": args.model, "config": args.config, "split": args.split, "device": device}
    path = analyze(model, batches, args.out, fractions=args.fractions, context=context)
    print(f"vlfuse: wrote {path}")
    return 0
