"""``vlfuse plot RUN``: draw a run's training curves from its CSV logs into a PNG.

    vlfuse plot runs/easy_vqa/latest                # runs/easy_vqa/version_N/curves.png
    vlfuse plot runs/easy_vqa/version_3 --out v3.png

Loads neither torch nor Lightning (:mod:`vlfuse.curves`): it runs in a second, also beside a training run.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from vlfuse.commands import SUBCOMMANDS
from vlfuse.curves import CURVES_FILE, METRICS_FILE, draw_run_curves
from vlfuse.runs import followed, latest_run


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``vlfuse plot``."""
    parser = argparse.ArgumentParser(
        prog="vlfuse plot",
        description=SUBCOMMANDS["plot"].description,
        epilog="examples:\n"
        "  vlfuse plot runs/easy_vqa/latest\n"
        "  vlfuse plot runs/easy_vqa          # its latest run\n"
        "  vlfuse plot runs/easy_vqa/version_3 --out version_3.png",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run", type=Path, metavar="RUN",
                        help="a run folder (runs/<name>/version_N or runs/<name>/latest), or a folder of runs (its latest)")
    parser.add_argument("--out", type=Path, metavar="FILE", help=f"the PNG to write (default: RUN/{CURVES_FILE})")
    return parser


def run_folder(path: Path) -> Path:
    """The run ``path`` names: itself (``latest`` followed), or, for a folder of runs without a log of
    its own (``runs/easy_vqa``), the run its ``latest`` points to."""
    if not (path / METRICS_FILE).is_file():
        return latest_run(path) or path
    return followed(path)


def main(argv: list[str]) -> int:
    """``vlfuse plot``: see :func:`build_parser`."""
    args = build_parser().parse_args(argv)
    if not args.run.is_dir():
        raise FileNotFoundError(f"no run folder {args.run}: give a run folder such as runs/easy_vqa/latest")
    path = draw_run_curves(run_folder(args.run), args.out)
    print(f"vlfuse: wrote the training curves to {path}")
    return 0
