"""Any VQA data in the Hugging Face layout: an imagefolder on disk, tables of rows, or a ``datasets`` dataset."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Protocol

import torch
from lightning.pytorch.utilities import rank_zero_only

from vlfuse.data import AnswerVocab, ImageQuestions
from vlfuse.data.imagefolder import (
    SPLIT_NAMES,
    LoadedSplit,
    column_mapping,
    find_split,
    load_hub_split,
    load_imagefolder_split,
    load_table,
    no_split,
    split_folder,
    split_label,
    subfolders,
)
from vlfuse.data.tables import READERS
from vlfuse.datamodules.base import SPLITS, VQADataModule

DATASETS_LOADERS = ("csv", "json", "parquet", "imagefolder", "text")
"""``datasets``' own loaders, which read files named by ``data_files``: vlfuse reads such files itself."""


@rank_zero_only
def _report(message: str) -> None:
    print(f"vlfuse: {message}", file=sys.stderr)


def _records(loaded: LoadedSplit, what: str) -> list[ImageQuestions]:
    """``loaded``'s records, having said how many bad rows of ``what`` were left out."""
    if loaded.skipped:
        _report(f"skipped {loaded.skipped} bad row{'' if loaded.skipped == 1 else 's'} of {what}")
    return loaded.records


def hold_out(
    records: list[ImageQuestions], val_fraction: float, test_fraction: float, seed: int, source: str
) -> dict[str, list[ImageQuestions]]:
    """``records`` as train, val and test: ``val_fraction`` and ``test_fraction`` of the images (at
    least one each, with all their questions) held out, chosen with ``seed``; each split in file order.

    Raises:
        ValueError: too few images to hold out both and keep one for training.
    """
    n_val, n_test = (max(1, round(len(records) * fraction)) for fraction in (val_fraction, test_fraction))
    if n_val + n_test >= len(records):
        raise ValueError(
            f"{source} has {len(records)} images: too few to hold out {n_val} for validation and {n_test} for test "
            "and train on the rest; give a table per split (data_files: {train: ..., validation: ..., test: ...})"
        )
    order = torch.randperm(len(records), generator=torch.Generator().manual_seed(seed)).tolist()
    split_of = {index: "val" for index in order[:n_val]} | {index: "test" for index in order[n_val : n_val + n_test]}
    splits: dict[str, list[ImageQuestions]] = {split: [] for split in SPLITS}
    for index, record in enumerate(records):
        splits[split_of.get(index, "train")].append(record)
    return splits


class _Source(Protocol):
    """Where the splits come from."""

    def has_split(self, split: str) -> bool:
        """Whether ``split`` is there (without reading it)."""

    def records(self, split: str, options: dict[str, Any]) -> list[ImageQuestions]:
        """The records of ``split``; ``options`` are :func:`~vlfuse.data.imagefolder.load_table`'s."""


class _Folders:
    """``DATA/{train,validation,test}/``, the split folders found by name, each with its metadata file."""

    def __init__(self, data_dir: str) -> None:
        self.data_dir = Path(data_dir)

    def has_split(self, split: str) -> bool:
        return find_split(subfolders(self.data_dir), split, str(self.data_dir), "/") is not None

    def records(self, split: str, options: dict[str, Any]) -> list[ImageQuestions]:
        loaded = load_imagefolder_split(split_folder(self.data_dir, split), **options)
        return _records(loaded, f"the {split_label(split)} split")


class _Tables:
    """A table per split: ``{train: a.csv, validation: b.csv, test: c.csv}`` (keys: :data:`SPLIT_NAMES`)."""

    def __init__(self, files: Mapping[str, str]) -> None:
        known = [name for names in SPLIT_NAMES.values() for name in names]
        unknown = [key for key in files if key not in known]
        if unknown:
            raise ValueError(f"data_files: unknown split {unknown[0]!r}; the splits are {', '.join(known)}")
        self.given = list(files)
        names = {split: find_split(files, split, "data_files") for split in SPLITS}
        self.files = {split: Path(files[name]) for split, name in names.items() if name is not None}

    def has_split(self, split: str) -> bool:
        return split in self.files

    def records(self, split: str, options: dict[str, Any]) -> list[ImageQuestions]:
        if split not in self.files:
            raise no_split(self.given, split, "data_files")
        path = self.files[split]
        return _records(load_table(path, **options), f"the {split_label(split)} split ({path})")


class _HeldOut:
    """One table for every split, its validation and test images held out (:func:`hold_out`)."""

    def __init__(self, path: str, val_fraction: float, test_fraction: float, seed: int) -> None:
        self.path = Path(path)
        self.fractions = (val_fraction, test_fraction)
        self.seed = seed
        self.splits: dict[str, list[ImageQuestions]] | None = None

    def has_split(self, split: str) -> bool:
        return True

    def records(self, split: str, options: dict[str, Any]) -> list[ImageQuestions]:
        if self.splits is None:
            records = _records(load_table(self.path, **options), str(self.path))
            self.splits = hold_out(records, *self.fractions, self.seed, str(self.path))
        return self.splits[split]


class _Hub:
    """A ``datasets`` dataset by hub name or local path, with ``train``, ``validation`` and ``test`` splits."""

    def __init__(self, name: str, config_name: str | None) -> None:
        if Path(name).is_file() or name in DATASETS_LOADERS:
            what = "a file" if Path(name).is_file() else "the name of one of datasets' loaders"
            raise ValueError(
                f"data.init_args.dataset {name!r} is {what}: give a table of rows (a {', '.join(READERS)} file) "
                "as data.init_args.data_files (a folder of split folders as data.init_args.data_dir)"
            )
        self.name = name
        self.config_name = config_name

    def has_split(self, split: str) -> bool:
        return True

    def records(self, split: str, options: dict[str, Any]) -> list[ImageQuestions]:
        loaded = load_hub_split(
            self.name, split_label(split), options["columns"], config_name=self.config_name, skip_bad_rows=options["skip_bad_rows"]
        )
        return _records(loaded, f"the {split_label(split)} split")


def _source(
    data_dir: str | None,
    data_files: str | dict[str, str] | None,
    dataset: str | None,
    dataset_config: str | None,
    fractions: tuple[float, float],
    seed: int,
) -> _Source:
    """The source that the one given of ``data_dir``, ``data_files`` and ``dataset`` names."""
    given = [name for name, value in (("data_dir", data_dir), ("data_files", data_files), ("dataset", dataset)) if value is not None]
    if len(given) != 1:
        both = f": {' and '.join(given)} are set (unset one: --data.init_args.{given[0]} null)" if given else ""
        raise ValueError(
            "give one of data.init_args.data_dir (a folder of split folders), data.init_args.data_files (a table of rows, "
            f"or a table per split) or data.init_args.dataset (a datasets name){both}"
        )
    if data_dir is not None:
        return _Folders(data_dir)
    if isinstance(data_files, str):
        return _HeldOut(data_files, *fractions, seed)
    if data_files is not None:
        return _Tables(data_files)
    return _Hub(dataset, dataset_config)


class ImageFolderDataModule(VQADataModule):
    """VQA data as ``DATA/{train,validation,test}/`` folders of images, each with a metadata file
    (``metadata.jsonl``, ``metadata.csv`` or ``metadata.parquet``; see :mod:`vlfuse.data.imagefolder`),
    as tables of rows beside the images, or as a ``datasets`` dataset.

    Every split present is read and checked in :meth:`setup`, before training starts: a bad row
    stops the run with one line naming the file, the line and the image.

    Args:
        data_dir: the folder holding the split folders ``train/``, ``validation/`` (or ``val/``,
            ``valid/``, ``dev/``) and ``test/`` (or ``testing/``).
        data_files: instead of ``data_dir``, tables of rows (CSV, JSON, JSON Lines or Parquet files),
            image paths relative to each table's folder: one table, whose validation and test images
            are held out (``val_fraction``, ``test_fraction``), or a table per split,
            ``{train: a.csv, validation: b.csv, test: c.csv}`` (split names as for ``data_dir``).
        dataset: instead, a ``datasets`` dataset by hub name or local path (needs ``pip install
            datasets``); its ``train``, ``validation`` and ``test`` splits are read.
        dataset_config: the ``datasets`` configuration name, if the dataset has several.
        columns: which column holds ``image``, ``question``, ``answer`` (a string) and ``answers``
            (a list of human answers) where they are named otherwise than ``file_name`` (``image``
            in a ``datasets`` dataset), ``question``, ``answer`` and ``answers``.
        val_fraction: for a single ``data_files`` table: the share of its images (at least one,
            with all their questions) held out for validation, chosen with ``seed``.
        test_fraction: likewise, for the test split.
        skip_bad_rows: leave out rows with malformed or non-strict JSON, CSV records the csv
            module refuses (an unclosed quote, a cell past its size limit), no question, no
            answer, a missing, unreadable or too large image, or a path outside the table's folder
            (the count per split is printed) instead of stopping.
        allow_outside_paths: for ``data_dir`` and ``data_files``: read an image path that is
            absolute or leads outside its table's folder (through ``..`` or a symbolic link); by
            default such a row is a bad row.
        top_k_answers: answer classes: the most frequent training answers; ``None`` keeps every
            answer. Questions answered otherwise are ignored by the loss.
        **kwargs: see :class:`VQADataModule`.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        data_files: dict[str, str] | str | None = None,
        dataset: str | None = None,
        dataset_config: str | None = None,
        columns: dict[str, str] | None = None,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        skip_bad_rows: bool = False,
        allow_outside_paths: bool = False,
        top_k_answers: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if top_k_answers is not None and top_k_answers < 1:
            raise ValueError(f"top_k_answers must be at least 1, got {top_k_answers}")
        for name, fraction in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
            if not 0.0 < fraction < 1.0:
                raise ValueError(f"{name} must be in (0, 1), got {fraction}")
        if val_fraction + test_fraction >= 1.0:
            raise ValueError(f"val_fraction + test_fraction must be under 1, got {val_fraction} + {test_fraction}")
        column_mapping(columns)  # names an unknown field now, not when a split is read
        self.source = _source(data_dir, data_files, dataset, dataset_config, (val_fraction, test_fraction), self.seed)
        self.columns = columns
        self.skip_bad_rows = skip_bad_rows
        self.allow_outside_paths = allow_outside_paths
        self.top_k_answers = top_k_answers

    def has_split(self, split: str) -> bool:
        """Whether ``split`` is there (a ``datasets`` dataset, or a held-out table, has all three)."""
        return self.source.has_split(split)

    def setup(self, stage: str) -> None:
        """Read and check every split present (and the training split), so bad rows show up now."""
        for split in SPLITS:
            if split == "train" or self.has_split(split):
                self.records(split)

    def load_records(self, split: str) -> list[ImageQuestions]:
        options = dict(
            columns=self.columns,
            skip_bad_rows=self.skip_bad_rows,
            image_size=self.image_size,
            allow_outside_paths=self.allow_outside_paths,
        )
        return self.source.records(split, options)

    def build_vocab(self, train: list[ImageQuestions]) -> AnswerVocab:
        return AnswerVocab.most_common((a for r in train for a in r.answers), self.top_k_answers)
