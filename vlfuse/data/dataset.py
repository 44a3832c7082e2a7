"""A torch Dataset over :class:`ImageQuestions` records and the collate function that batches them."""

from __future__ import annotations

from typing import Sequence

import torch
from torch.utils.data import Dataset

from vlfuse.data.answers import AnswerVocab
from vlfuse.data.records import ImageQuestions
from vlfuse.data.transforms import preprocess_image

IGNORE_INDEX = -100
"""Label of an answer outside the vocabulary: ignored by the loss (as in ``F.cross_entropy``)."""


class GroupedVQADataset(Dataset):
    """Yields one image with all its questions: ``{"pixel_values", "questions", "labels"}``.

    Args:
        records: the images and their questions.
        vocab: answer vocabulary; answers outside it get :data:`IGNORE_INDEX`.
        image_size: side of the square tensor each image is resized to.
    """

    def __init__(self, records: Sequence[ImageQuestions], vocab: AnswerVocab, image_size: int) -> None:
        self.records = records
        self.vocab = vocab
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        record = self.records[i]
        labels = [self.vocab.index(a) if a in self.vocab else IGNORE_INDEX for a in record.answers]
        return {
            "pixel_values": preprocess_image(record.image, self.image_size),
            "questions": list(record.questions),
            "labels": torch.tensor(labels, dtype=torch.long),
        }

    @property
    def num_questions(self) -> int:
        return sum(len(r.questions) for r in self.records)


def collate_grouped(items: list[dict]) -> dict:
    """Batch images and flatten their questions.

    Returns:
        ``pixel_values`` (Bi, 3, S, S); ``questions`` list of Bq strings; ``labels`` (Bq,);
        ``image_index`` (Bq,) the image row of each question.
    """
    counts = torch.tensor([len(item["questions"]) for item in items])
    return {
        "pixel_values": torch.stack([item["pixel_values"] for item in items]),
        "questions": [q for item in items for q in item["questions"]],
        "labels": torch.cat([item["labels"] for item in items]),
        "image_index": torch.repeat_interleave(torch.arange(len(items)), counts),
    }
