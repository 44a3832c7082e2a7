"""Any VQA data in the Hugging Face layout: an imagefolder on disk, or a ``datasets`` dataset."""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_only

from vlfuse.data import AnswerVocab, ImageQuestions
from vlfuse.data.imagefolder import METADATA_FILE, LoadedSplit, load_hub_split, load_imagefolder_split
from vlfuse.datamodules.base import SPLITS, VQADataModule

FOLDERS = {"train": "train", "val": "validation", "test": "test"}
"""vlfuse's split -> the folder (and ``datasets`` split) of the Hugging Face layout."""


@rank_zero_only
def _report(message: str) -> None:
    print(f"vlfuse: {message}", file=sys.stderr)


class ImageFolderDataModule(VQADataModule):
    """VQA data as ``DATA/{train,validation,test}/`` folders of images, each with a ``metadata.jsonl``
    (see :mod:`vlfuse.data.imagefolder`), or as a ``datasets`` dataset.

    Every split present is read and checked in :meth:`setup`, before training starts: a bad row
    stops the run with one line naming the metadata file, the line and the image.

    Args:
        data_dir: the folder holding ``train/``, ``validation/`` and ``test/``.
        dataset: instead of ``data_dir``, a ``datasets`` dataset by hub name or local path (needs
            ``pip install datasets``); its ``train``, ``validation`` and ``test`` splits are read.
        dataset_config: the ``datasets`` configuration name, if the dataset has several.
        columns: for ``dataset``: which column holds ``image``, ``question``, ``answer`` (a string)
            and ``answers`` (a list of human answers); unnamed ones keep those names.
        skip_bad_rows: leave out rows with malformed JSON, no question, no answer, a missing,
            unreadable or too large image, or a path outside the split's folder (the count per
            split is printed) instead of stopping.
        allow_outside_paths: for ``data_dir``: read a ``file_name`` that is absolute or leads
            outside its split's folder (through ``..`` or a symbolic link); by default such a row
            is a bad row.
        top_k_answers: answer classes: the most frequent training answers; ``None`` keeps every
            answer. Questions answered otherwise are ignored by the loss.
        **kwargs: see :class:`VQADataModule`.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        dataset: str | None = None,
        dataset_config: str | None = None,
        columns: dict[str, str] | None = None,
        skip_bad_rows: bool = False,
        allow_outside_paths: bool = False,
        top_k_answers: int | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if (data_dir is None) == (dataset is None):
            raise ValueError("give one of data.init_args.data_dir (a folder) or data.init_args.dataset (a datasets name)")
        if columns and dataset is None:
            raise ValueError("data.init_args.columns maps the columns of a datasets dataset; a folder's metadata.jsonl uses file_name, question, answer(s)")
        if top_k_answers is not None and top_k_answers < 1:
            raise ValueError(f"top_k_answers must be at least 1, got {top_k_answers}")
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.dataset_name = dataset
        self.dataset_config = dataset_config
        self.columns = columns
        self.skip_bad_rows = skip_bad_rows
        self.allow_outside_paths = allow_outside_paths
        self.top_k_answers = top_k_answers

    def has_split(self, split: str) -> bool:
        """Whether ``split`` exists on disk (a ``datasets`` dataset is assumed to have all three)."""
        return self.data_dir is None or (self.data_dir / FOLDERS[split] / METADATA_FILE).is_file()

    def setup(self, stage: str) -> None:
        """Read and check every split present (and the training split), so bad rows show up now."""
        for split in SPLITS:
            if split == "train" or self.has_split(split):
                self.records(split)

    def load_records(self, split: str) -> list[ImageQuestions]:
        loaded = self._load(FOLDERS[split])
        if loaded.skipped:
            _report(f"skipped {loaded.skipped} bad row{'' if loaded.skipped == 1 else 's'} of the {FOLDERS[split]} split")
        return loaded.records

    def _load(self, folder: str) -> LoadedSplit:
        if self.data_dir is not None:
            return load_imagefolder_split(
                self.data_dir / folder,
                skip_bad_rows=self.skip_bad_rows,
                image_size=self.image_size,
                allow_outside_paths=self.allow_outside_paths,
            )
        return load_hub_split(
            self.dataset_name, folder, self.columns, config_name=self.dataset_config, skip_bad_rows=self.skip_bad_rows
        )

    def build_vocab(self, train: list[ImageQuestions]) -> AnswerVocab:
        return AnswerVocab.most_common((a for r in train for a in r.answers), self.top_k_answers)
