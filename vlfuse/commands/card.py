"""``vlfuse card``: print a model folder's card, written from its ``config.json``; ``--write`` rewrites its README.md.

    vlfuse card runs/easy_vqa/latest/model
    vlfuse card runs/easy_vqa/latest/model --write

The card is what :mod:`vlfuse.model_card` writes from the facts the folder records (the run, its
metrics, the architecture and versions); the folder's digests do not cover it, so rewriting it
(atomically) leaves the folder loadable.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from vlfuse import model_card, model_io
from vlfuse.commands import SUBCOMMANDS


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``vlfuse card``."""
    parser = argparse.ArgumentParser(
        prog="vlfuse card",
        description=SUBCOMMANDS["card"].description,
        epilog="example:\n  vlfuse card runs/easy_vqa/latest/model --write",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", type=Path, help="a model folder (written by save_pretrained, vlfuse fit or vlfuse prune)")
    parser.add_argument("--write", action="store_true", help="rewrite MODEL/README.md with the card (atomically) instead of printing it")
    return parser


def main(argv: list[str]) -> int:
    """``vlfuse card``: see :func:`build_parser`."""
    args = build_parser().parse_args(argv)
    meta = model_card.read_folder_meta(args.model)
    if args.write:
        path = model_card.write_card(args.model, meta)
        print(f"vlfuse card: wrote {path}")
        return 0
    card = str(model_card.render(args.model, meta))
    print(card, end="")
    written = args.model / model_io.CARD_FILE
    if not written.is_file():
        print(f"vlfuse card: {args.model} has no {model_io.CARD_FILE} yet: --write writes this card there", file=sys.stderr)
    elif written.read_text(encoding="utf-8", errors="replace") != card:
        print(f"vlfuse card: {written} differs from this card (edited, or written from other facts): --write replaces it", file=sys.stderr)
    return 0
