"""``vlfuse analyze``: what each attention head does and which heads matter, as a markdown report.

    vlfuse analyze --model runs/easy_vqa/model --config configs/easy_vqa.yaml --out reports/easy_vqa

The data come from the ``data:`` section of a ``vlfuse fit`` config (any option can be overridden
as in ``vlfuse fit``: ``--data.init_args.limit_images 64``); labels are read against the model's own
answer vocabulary, so the training split is never loaded for it.
"""

from __future__ import annotations

import argparse

from vlfuse.analysis.analyze import DEFAULT_FRACTIONS, analyze
from vlfuse.analysis.data import add_data_arguments, build_datamodule, load_batches, parse_with_data_overrides
from vlfuse.commands import SUBCOMMANDS
from vlfuse.model import VLFuseModel
from vlfuse.runtime import add_device_argument, add_threads_argument, set_threads


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
