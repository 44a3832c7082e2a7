"""A torch Dataset over :class:`ImageQuestions` records and the collate function that batches them."""

from __future__ import annotations

import os
from functools import cached_property
from pathlib import Path
from typing import Container, Sequence

import torch
from torch.utils.data import Dataset, get_worker_info

from vlfuse.data.answers import AnswerVocab
from vlfuse.data.records import ImageQuestions, ImageSource
from vlfuse.data.transforms import check_interpolation, preprocess_image

IGNORE_INDEX = -100
"""Label of an answer outside the vocabulary: ignored by the loss (as in ``F.cross_entropy``)."""
NO_ANSWER = -1
"""Padding of ``human_labels``: a question with fewer human answers than the widest in its batch."""
KEEP_DECODED_BYTES = 512 * 2**20
"""How many bytes of decoded, resized images a :class:`GroupedVQADataset` keeps for later epochs."""


class GroupedVQADataset(Dataset):
    """Yields one image with all its questions: ``{"pixel_values", "image_key", "questions",
    "labels"}``, and ``human_labels`` (Q, A) when the record has every annotator's answers (see
    :func:`human_labels`).

    Args:
        records: the images and their questions.
        vocab: answer vocabulary; answers outside it get :data:`IGNORE_INDEX`.
        image_size: side of the square tensor each image is resized to.
        interpolation: how it is resized (see :func:`~vlfuse.data.transforms.preprocess_image`).
        keep_decoded_bytes: keep each decoded, resized image for the next epochs, up to this
            many bytes in all (the first images, in the order they are asked for); 0 decodes every
            image each time. A 32x32 image takes 12 KiB (easy-VQA's default size), a 224x224 one
            588 KiB. DataLoader worker processes keep none (see :meth:`decoded_budget`).

    Attributes:
        decode_images: load and resize each image into ``pixel_values``. ``False`` (see
            :meth:`decode_only_uncached`) leaves ``pixel_values`` out: a model that has every
            image's features cached needs only the ``image_key``.
    """

    def __init__(
        self,
        records: Sequence[ImageQuestions],
        vocab: AnswerVocab,
        image_size: int,
        keep_decoded_bytes: int = KEEP_DECODED_BYTES,
        *,
        interpolation: str = "bilinear",
    ) -> None:
        self.records = records
        self.vocab = vocab
        self.image_size = image_size
        self.interpolation = check_interpolation(interpolation)
        self.decode_images = True
        self.keep_decoded_bytes = keep_decoded_bytes
        self._decoded: dict[int, torch.Tensor] = {}
        self._decoded_bytes = 0

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> dict:
        return grouped_item(self.records[i], self.vocab, self.image_keys[i], self.pixels(i) if self.decode_images else None)

    def pixels(self, i: int) -> torch.Tensor:
        """Record ``i``'s image as ``(3, S, S)`` in [0, 1], decoded once while the budget lasts."""
        kept = self._decoded.get(i)
        if kept is not None:
            return kept
        pixels = preprocess_image(self.records[i].image, self.image_size, self.interpolation)
        size = pixels.numel() * pixels.element_size()
        if self._decoded_bytes + size <= self.decoded_budget():
            self._decoded[i] = pixels
            self._decoded_bytes += size
        return pixels

    def decoded_budget(self) -> int:
        """The bytes of decoded images this process may keep: ``keep_decoded_bytes``, and none in a
        DataLoader worker, which lasts one pass over the data (the datamodules' loaders start their
        workers anew each pass): what it kept would leave with it. With workers, images are decoded
        in parallel every pass instead."""
        return 0 if get_worker_info() is not None else self.keep_decoded_bytes

    @property
    def num_questions(self) -> int:
        return sum(len(r.questions) for r in self.records)

    @cached_property
    def image_keys(self) -> list[str | None]:
        """:func:`image_key` of each record's image."""
        return [image_key(r.image) for r in self.records]

    def decode_only_uncached(self, cached: Container[str]) -> None:
        """Decode no image once every one is in ``cached`` (e.g. a frozen image encoder's
        :class:`~vlfuse.encoders.FeatureCache`, keyed by :func:`image_key`); decode them all
        again as soon as one is not (an image held in memory never is)."""
        self.decode_images = not all(key is not None and key in cached for key in self.image_keys)


def grouped_item(record: ImageQuestions, vocab: AnswerVocab, key: str | None, pixels: torch.Tensor | None) -> dict:
    """One item of :class:`GroupedVQADataset` (and of the streaming shards, :mod:`vlfuse.data.streaming`):
    ``record``'s questions, their answers' labels in ``vocab`` (:data:`IGNORE_INDEX` outside it), its
    ``human_labels`` when it has every annotator's answers, the ``image_key`` ``key`` and, unless
    ``None``, ``pixel_values``."""

    def indices(answers: Sequence[str]) -> list[int]:
        return [vocab.index(a) if a in vocab else IGNORE_INDEX for a in answers]

    item = {"image_key": key, "questions": list(record.questions), "labels": torch.tensor(indices(record.answers), dtype=torch.long)}
    if pixels is not None:
        item["pixel_values"] = pixels
    if record.human_answers:
        item["human_labels"] = human_labels([indices(h) for h in record.human_answers])
    return item


def image_key(source: ImageSource) -> str | None:
    """What names an image file from one epoch to the next: its absolute path; ``None`` for an
    image held in memory (a PIL image or an array), which only its pixels identify."""
    return os.path.abspath(source) if isinstance(source, (str, Path)) else None


def human_labels(rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """Answer indices of every annotator, one row per question, padded with :data:`NO_ANSWER`.

    Args:
        rows: per question, the vocabulary index of each human answer (:data:`IGNORE_INDEX` for
            an answer outside the vocabulary: it counts as an annotator no prediction matches).

    Returns:
        ``(len(rows), max answers per question)`` long tensor.
    """
    width = max((len(r) for r in rows), default=0)
    table = torch.full((len(rows), width), NO_ANSWER, dtype=torch.long)
    for i, row in enumerate(rows):
        table[i, : len(row)] = torch.tensor(row, dtype=torch.long)
    return table


def collate_grouped(items: list[dict]) -> dict:
    """Batch images and flatten their questions.

    Returns:
        ``pixel_values`` (Bi, 3, S, S), or ``None`` when the items were not decoded (see
        :attr:`GroupedVQADataset.decode_images`); ``image_keys`` list of Bi :func:`image_key`;
        ``questions`` list of Bq strings; ``labels`` (Bq,);
        ``image_index`` (Bq,) the image row of each question; and, when any item has them,
        ``human_labels`` (Bq, A) padded with :data:`NO_ANSWER` (all of a row, for the questions
        of an item without human answers).
    """
    counts = torch.tensor([len(item["questions"]) for item in items])
    decoded = "pixel_values" in items[0]  # all items of a dataset are, or none
    batch = {
        "pixel_values": torch.stack([item["pixel_values"] for item in items]) if decoded else None,
        "image_keys": [item.get("image_key") for item in items],
        "questions": [q for item in items for q in item["questions"]],
        "labels": torch.cat([item["labels"] for item in items]),
        "image_index": torch.repeat_interleave(torch.arange(len(items)), counts),
    }
    if any("human_labels" in item for item in items):
        rows = [
            row
            for item, count in zip(items, counts.tolist())
            for row in (item["human_labels"].tolist() if "human_labels" in item else [[]] * count)
        ]
        batch["human_labels"] = human_labels(rows)  # (Bq, A)
    return batch
