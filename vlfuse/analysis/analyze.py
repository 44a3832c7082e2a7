"""``vlfuse analyze``: what each fusion head does and which heads matter, as a markdown report.

    vlfuse analyze --model runs/easy_vqa/model --config configs/easy_vqa.yaml --out reports/easy_vqa

The data come from the ``data:`` section of a ``vlfuse fit`` config (any option can be overridden
as in ``vlfuse fit``: ``--data.init_args.limit_images 64``); labels are read against the model's own
answer vocabulary, so the training split is never loaded for it.
"""

from __future__ import annotations

import argparse
import json
from itertools import islice
from pathlib import Path
from typing import Sequence

import jsonargparse
import torch
import yaml
from torch.utils.data import DataLoader

from vlfuse.analysis.collect import collect_head_stats
from vlfuse.analysis.head_scores import (
    ablation_scores,
    evaluate,
    gradient_scores,
    original_head_count,
    pruning_curve,
    weight_norm_scores,
)
from vlfuse.analysis.report import write_report
from vlfuse.data import IGNORE_INDEX, AnswerVocab, GroupedVQADataset, collate_grouped
from vlfuse.datamodules import VQADataModule
from vlfuse.datamodules.base import SPLITS
from vlfuse.model import VLFuseModel

DEFAULT_FRACTIONS = tuple(round(0.1 * i, 1) for i in range(10))
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


def build_datamodule(config: str | Path, overrides: Sequence[str] = ()) -> VQADataModule:
    """The datamodule of a ``vlfuse fit`` config's ``data:`` section, with ``--data.*`` overrides.

    Raises:
        FileNotFoundError: the config file does not exist.
        ValueError: the file has no ``data:`` section, or it (with the overrides) does not
            describe a :class:`VQADataModule`; the message names the file.
    """
    path = Path(config)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    content = yaml.safe_load(path.read_text())
    if not isinstance(content, dict) or "data" not in content:
        raise ValueError(f"{path} has no data: section (the datamodule of a vlfuse fit config)")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(VQADataModule, "data", required=True)
    try:
        parsed = parser.parse_args([f"--data={json.dumps(content['data'])}", *overrides])
    except argparse.ArgumentError as err:
        message = " ".join(str(err).split())  # jsonargparse's message spans many indented lines
        raise ValueError(f"{path}: the data section does not describe a datamodule: {message}") from err
    return parser.instantiate(parsed).data


def load_batches(
    datamodule: VQADataModule, model: VLFuseModel, split: str = "val", max_batches: int | None = None
) -> list[dict]:
    """The first ``max_batches`` batches (default: all) of ``split``, labelled with the model's answers.

    Images are resized to the model's image size; answers outside the model's vocabulary get
    ``IGNORE_INDEX``.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    size = model.config.image.image_size
    if datamodule.image_size not in (None, size):
        raise ValueError(f"data.image_size ({datamodule.image_size}) differs from the model's image size ({size})")
    dataset = GroupedVQADataset(datamodule.records(split), AnswerVocab(model.answers), size)
    loader = DataLoader(
        dataset, batch_size=datamodule.batch_size, num_workers=datamodule.num_workers, collate_fn=collate_grouped
    )
    batches = list(islice(loader, max_batches))
    if not any(bool((b["labels"] != IGNORE_INDEX).any()) for b in batches):
        raise ValueError(f"the {split} split has no question whose answer the model knows (or no question at all)")
    return batches


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
    scores = {
        "weight norm": weight_norm_scores(model),
        "weight norm s_i": weight_norm_scores(model, average_layers=True),
        "gradient": gradient_scores(model, batches),
        "ablation": ablation_scores(model, batches),
    }
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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="vlfuse analyze",
        description="Head statistics, role tags, importance scores and pruning curves of a saved model, "
        "as OUT/report.md with PNG figures. Any --data.* option of the config can be overridden "
        "(e.g. --data.init_args.limit_images 64).",
    )
    parser.add_argument("--model", required=True, help="a directory written by save_pretrained")
    parser.add_argument("--config", required=True, help="a vlfuse fit config; its data: section gives the data")
    parser.add_argument("--out", required=True, help="the report folder (created)")
    parser.add_argument("--split", default="val", choices=SPLITS, help="the split to analyse (default: val)")
    parser.add_argument("--max-batches", type=int, default=None, help="analyse only the first N batches")
    parser.add_argument(
        "--limit-images", type=int, default=None,
        help="keep only the first N images of the split (the same as --data.init_args.limit_images N)",
    )
    parser.add_argument(
        "--fractions", type=float, nargs="+", default=list(DEFAULT_FRACTIONS),
        help="fractions of heads to prune for the accuracy curves (default: 0 0.1 ... 0.9)",
    )
    parser.add_argument("--device", default=None, help="e.g. cpu or cuda (default: cuda when available)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``vlfuse analyze``: returns the exit status (user errors are raised as ``ValueError``)."""
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-") and not a.startswith("--data.")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    for option, value in (("--max-batches", args.max_batches), ("--limit-images", args.limit_images)):
        if value is not None and value < 1:
            parser.error(f"{option} must be at least 1, got {value}")
    if any(not 0.0 <= f < 1.0 for f in args.fractions):
        parser.error(f"--fractions must be in [0, 1), got {args.fractions}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.limit_images is not None:
        rest.append(f"--data.init_args.limit_images={args.limit_images}")
    datamodule = build_datamodule(args.config, rest)
    model = VLFuseModel.from_pretrained(args.model, map_location=device)
    batches = load_batches(datamodule, model, args.split, args.max_batches)
    context = {"model": args.model, "config": args.config, "split": args.split, "device": device}
    path = analyze(model, batches, args.out, fractions=args.fractions, context=context)
    print(f"vlfuse: wrote {path}")
    return 0
