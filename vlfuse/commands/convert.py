"""``vlfuse convert``: a config's VQA data as streaming shards (``litdata.optimize``), which
``vlfuse.datamodules.StreamingDataModule`` trains from (configs/streaming_vqa.yaml).

    vlfuse convert --config configs/imagefolder_vqa.yaml --data.init_args.data_dir DATA --out shards/DATA
    vlfuse convert --data-dir DATA --out shards/DATA          # the same, for an imagefolder
    vlfuse fit --config configs/streaming_vqa.yaml --data.init_args.data_dir shards/DATA

Each split of the data (train, val, test: those it has) becomes a litdata dataset of one item per
image (its encoded bytes as stored, its questions and answers), beside an index of the answer
vocabulary, the training questions and the counts (:mod:`vlfuse.data.streaming`). The shards are
written into a staging folder beside ``--out`` and renamed to it at the end: ``--out`` is whole or
absent, and an existing one is never overwritten.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from vlfuse.commands import SUBCOMMANDS

OVERRIDES = ("--data.",)
IMAGEFOLDER = "vlfuse.datamodules.ImageFolderDataModule"


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``vlfuse convert``; ``--data.*`` options override the config's data section."""
    parser = argparse.ArgumentParser(
        prog="vlfuse convert",
        description=SUBCOMMANDS["convert"].description,
        epilog="any --data.* option of vlfuse fit overrides the config's, e.g.\n"
        "  vlfuse convert --config configs/vqa_v2.yaml --data.init_args.data_dir /data/vqa_v2 --out shards/vqa_v2\n"
        "then train with vlfuse fit --config configs/streaming_vqa.yaml --data.init_args.data_dir shards/vqa_v2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, metavar="C", help="a vlfuse fit config whose data: section to convert")
    source.add_argument("--data-dir", type=Path, metavar="DATA",
                        help="instead, an imagefolder (DATA/{train,validation,test}/ with metadata files)")
    parser.add_argument("--out", type=Path, required=True, metavar="DIR", help="the new shard folder (never overwritten)")
    parser.add_argument("--chunk-bytes", default="64MB", metavar="SIZE",
                        help="litdata's chunk size, e.g. 64MB (the default) or 256MB")
    parser.add_argument("--workers", type=int, default=1, metavar="N",
                        help="litdata.optimize worker processes (default 1: each split's items in its order)")
    return parser


def parse(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command's own arguments and the ``--data.*`` overrides."""
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-") and not a.startswith(OVERRIDES)]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.workers < 1:
        parser.error(f"--workers must be at least 1, got {args.workers}")
    return args, rest


def datamodule(args: argparse.Namespace, overrides: Sequence[str]):
    """The datamodule to convert: the config's, or an imagefolder's, with ``overrides``."""
    from vlfuse.analysis.data import build_datamodule, datamodule_from

    if args.config is not None:
        return build_datamodule(args.config, overrides)
    if not args.data_dir.is_dir():
        raise FileNotFoundError(f"--data-dir {args.data_dir} is not a folder")
    return datamodule_from({"class_path": IMAGEFOLDER, "init_args": {"data_dir": str(args.data_dir)}}, overrides, "--data-dir")


def main(argv: Sequence[str]) -> int:
    args, overrides = parse(argv)
    from vlfuse.data.streaming import write_shards
    from vlfuse.datamodules import StreamingDataModule
    from vlfuse.datamodules.base import SPLITS

    if args.out.exists():
        raise ValueError(f"--out {args.out} exists: give a new folder (vlfuse convert never overwrites one)")
    data = datamodule(args, overrides)
    if isinstance(data, StreamingDataModule):
        raise ValueError(f"{args.config}: its data is already streaming shards ({data.data_dir})")
    present = [split for split in SPLITS if split == "train" or getattr(data, "has_split", lambda _: True)(split)]
    splits = {split: data.records(split) for split in present}  # every row checked, as vlfuse fit checks them
    source = f"{type(data).__module__}.{type(data).__name__} of {args.config or args.data_dir}"
    try:
        out = write_shards(
            splits, data.data_vocab.answers, args.out, source=source, chunk_bytes=args.chunk_bytes, workers=args.workers,
            report=lambda line: print(line, file=sys.stderr),
        )
    except FileExistsError as err:  # --out appeared meanwhile
        raise ValueError(str(err)) from None
    counts = ", ".join(f"{split} {len(records):,} images" for split, records in splits.items())
    print(f"vlfuse: wrote the shards of {counts} to {out}")
    return 0
