"""easy-VQA as a LightningDataModule, with a validation split held out by image."""

from __future__ import annotations

from functools import cached_property

import torch

from vlfuse.data import AnswerVocab, ImageQuestions
from vlfuse.data.easy_vqa import easy_vqa_answers, load_easy_vqa
from vlfuse.datamodules.base import VQADataModule


class EasyVQADataModule(VQADataModule):
    """easy-VQA: train on the training images minus a held-out share, test on the official test split.

    Args:
        val_fraction: share of the training *images* (with all their questions) held out for
            validation, chosen with ``seed``.
        **kwargs: see :class:`VQADataModule`.
    """

    def __init__(self, val_fraction: float = 0.1, **kwargs) -> None:
        super().__init__(**kwargs)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.val_fraction = val_fraction

    @cached_property
    def _train_and_val(self) -> tuple[list[ImageQuestions], list[ImageQuestions]]:
        images = load_easy_vqa("train")
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(self.seed)).tolist()
        n_val = round(len(images) * self.val_fraction)
        held_out = set(order[:n_val])
        train = [r for i, r in enumerate(images) if i not in held_out]
        val = [r for i, r in enumerate(images) if i in held_out]
        return train, val

    def load_records(self, split: str) -> list[ImageQuestions]:
        if split == "test":
            return load_easy_vqa("test")
        train, val = self._train_and_val
        return train if split == "train" else val

    def build_vocab(self, train: list[ImageQuestions]) -> AnswerVocab:
        return AnswerVocab(easy_vqa_answers())
