"""The data of ``vlfuse analyze`` and ``vlfuse prune``: a ``vlfuse fit`` config's datamodule and its batches.

The datamodule comes from the config's ``data:`` section, validated as ``vlfuse fit`` does, with
``--data.*`` overrides (``--data.init_args.limit_images 64``). Batches are labelled with the
model's own answers, so the training split is never loaded for a vocabulary.
"""

from __future__ import annotations

import argparse
import json
from itertools import islice
from pathlib import Path
from typing import Sequence

import jsonargparse
import yaml
from torch.utils.data import DataLoader

from vlfuse.data import IGNORE_INDEX, AnswerVocab, GroupedVQADataset, collate_grouped
from vlfuse.datamodules import VQADataModule
from vlfuse.datamodules.base import SPLITS
from vlfuse.model import VLFuseModel


def read_config(path: str | Path) -> dict:
    """The YAML config of a ``vlfuse fit`` run, as a dict.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: the file is not a YAML mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    content = yaml.safe_load(path.read_text())
    if not isinstance(content, dict):
        raise ValueError(f"{path} is not a YAML mapping")
    return content


def build_datamodule(config: str | Path, overrides: Sequence[str] = ()) -> VQADataModule:
    """The datamodule of a ``vlfuse fit`` config's ``data:`` section, with ``--data.*`` overrides.

    Raises:
        FileNotFoundError: the config file does not exist.
        ValueError: the file has no ``data:`` section, or it (with the overrides) does not
            describe a :class:`VQADataModule`; the message names the file.
    """
    path = Path(config)
    content = read_config(path)
    if "data" not in content:
        raise ValueError(f"{path} has no data: section (the datamodule of a vlfuse fit config)")
    return datamodule_from(content["data"], overrides, str(path))


def datamodule_from(section: dict, overrides: Sequence[str] = (), where: str = "data") -> VQADataModule:
    """The datamodule a config's ``data:`` section (``{"class_path": ..., "init_args": {...}}``)
    describes, with ``--data.*`` overrides; a ``ValueError`` names ``where`` otherwise."""
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(VQADataModule, "data", required=True)
    try:
        parsed = parser.parse_args([f"--data={json.dumps(section)}", *overrides])
    except argparse.ArgumentError as err:
        message = " ".join(str(err).split())  # jsonargparse's message spans many indented lines
        raise ValueError(f"{where}: the data section does not describe a datamodule: {message}") from err
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


def add_data_arguments(parser: argparse.ArgumentParser, split_help: str) -> argparse._ArgumentGroup:
    """Add ``--split``, ``--max-batches`` and ``--limit-images`` to ``parser``; returns their group.

    Read the arguments with :func:`parse_with_data_overrides`, which also takes ``--data.*`` options.
    """
    group = parser.add_argument_group(
        "data", "any --data.* option of the config can be overridden, e.g. --data.init_args.limit_images 64"
    )
    group.add_argument("--split", default="val", choices=SPLITS, help=split_help)
    group.add_argument("--max-batches", type=int, metavar="N", help="use only the first N batches of each split read")
    group.add_argument(
        "--limit-images", type=int, metavar="N",
        help="keep only the first N images of each split (the same as --data.init_args.limit_images N)",
    )
    return group


def parse_with_data_overrides(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None
) -> tuple[argparse.Namespace, list[str]]:
    """Parse ``argv`` with ``parser`` (see :func:`add_data_arguments`), keeping ``--data.*`` options aside.

    Returns:
        The parsed arguments and the overrides for :func:`build_datamodule` (``--limit-images`` included).
    """
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-") and not a.startswith("--data.")]
    if unknown:
        parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    for option, value in (("--max-batches", args.max_batches), ("--limit-images", args.limit_images)):
        if value is not None and value < 1:
            parser.error(f"{option} must be at least 1, got {value}")
    if args.limit_images is not None:
        rest.append(f"--data.init_args.limit_images={args.limit_images}")
    return args, rest
