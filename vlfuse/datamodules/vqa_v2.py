"""VQA v2 as a LightningDataModule: official train (minus a held-out share), official val as test."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Optional

import torch

from vlfuse.data import AnswerVocab, ImageQuestions
from vlfuse.data.vqa_v2 import VQAv2Data, load_vqa_v2
from vlfuse.datamodules.base import VQADataModule


class VQAv2DataModule(VQADataModule):
    """VQA v2 in the official layout.

    'train' is the official training split less ``val_fraction`` of its images, held out (with all
    their questions) as 'val' for model selection; 'test' is the official val split, since the
    answers of the official test splits are not public (set ``test_split`` to a split whose
    annotations you have to test on it instead). File locations are patterns formatted with the
    official split name (``train2014``, ``val2014``), relative to ``data_dir``.

    Args:
        data_dir: root folder of the files.
        train_split: official split trained on.
        test_split: official split tested on (it needs an annotations file).
        val_fraction: share of the training images held out for validation, chosen with ``seed``.
        questions_file: pattern of the questions JSON.
        annotations_file: pattern of the annotations JSON.
        image_dir: pattern of the image folder.
        image_pattern: file name of an image, formatted with ``image_id``; ``None`` is the COCO
            name ``COCO_<image folder name>_<12-digit image_id>.jpg``.
        top_k_answers: answer classes: the most frequent training answers (majority answer of
            each question, normalised); questions answered otherwise are ignored by the loss.
        skip_bad: leave out (and count, in a warning) malformed records, questions without
            annotations and questions whose image is missing, instead of raising.
        **kwargs: see :class:`VQADataModule`.
    """

    def __init__(
        self,
        data_dir: str,
        train_split: str = "train2014",
        test_split: str = "val2014",
        val_fraction: float = 0.05,
        questions_file: str = "v2_OpenEnded_mscoco_{split}_questions.json",
        annotations_file: str = "v2_mscoco_{split}_annotations.json",
        image_dir: str = "{split}",
        image_pattern: Optional[str] = None,
        top_k_answers: int = 3129,
        skip_bad: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        if top_k_answers < 1:
            raise ValueError(f"top_k_answers must be at least 1, got {top_k_answers}")
        self.data_dir = Path(data_dir)
        self.train_split = train_split
        self.test_split = test_split
        self.val_fraction = val_fraction
        self.questions_file = questions_file
        self.annotations_file = annotations_file
        self.image_dir = image_dir
        self.image_pattern = image_pattern
        self.top_k_answers = top_k_answers
        self.skip_bad = skip_bad

    def load_official(self, split: str) -> VQAv2Data:
        """Every image of an official split (``train2014``, ``val2014``, ...) with its questions."""
        root = self.data_dir
        questions = root / self.questions_file.format(split=split)
        annotations = root / self.annotations_file.format(split=split)
        missing = next((path for path in (annotations, questions) if not path.is_file()), None)
        if missing is not None:
            raise FileNotFoundError(
                f"VQA v2 file not found: {missing}: set --data.init_args.data_dir to the folder that holds VQA v2 "
                f"(now {str(root)!r}; docs/datasets.md says what to download)"
            )
        return load_vqa_v2(
            questions, annotations, root / self.image_dir.format(split=split),
            image_pattern=self.image_pattern, skip_bad=self.skip_bad,
        )

    @cached_property
    def _train_and_val(self) -> tuple[list[ImageQuestions], list[ImageQuestions]]:
        images = self.load_official(self.train_split).records
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(self.seed)).tolist()
        held_out = set(order[: round(len(images) * self.val_fraction)])
        train = [r for i, r in enumerate(images) if i not in held_out]
        val = [r for i, r in enumerate(images) if i in held_out]
        return train, val

    @cached_property
    def _test(self) -> list[ImageQuestions]:
        return self.load_official(self.test_split).records

    def load_records(self, split: str) -> list[ImageQuestions]:
        if split == "test":
            return self._test
        train, val = self._train_and_val
        return train if split == "train" else val

    def build_vocab(self, train: list[ImageQuestions]) -> AnswerVocab:
        return AnswerVocab.most_common((a for r in train for a in r.answers), self.top_k_answers)
