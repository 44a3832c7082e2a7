"""Captioned images: the record, a torch Dataset over records, its sampler and collate function."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import numpy as np
import torch
from torch.utils.data import Dataset

from vlfuse.data.records import ImageSource
from vlfuse.data.resumable import EpochShuffleSampler
from vlfuse.data.shapes import Scene
from vlfuse.data.transforms import check_interpolation, preprocess_image


@dataclass
class ImageCaptions:
    """One image with every caption written for it.

    Attributes:
        image: a path, PIL image or RGB uint8 array (H, W, 3).
        captions: the reference captions (at least one).
        image_id: identifies the image in batches and reports.
        scene: the SHAPES scene the image shows, when it was generated (``None`` otherwise).
    """

    image: ImageSource
    captions: list[str]
    image_id: str = ""
    scene: Optional[Scene] = None

    def __post_init__(self) -> None:
        if not self.captions:
            raise ValueError(f"image {self.image_id!r} has no caption")


class EpochTaggedSampler(EpochShuffleSampler):
    """:class:`EpochShuffleSampler`'s order, each index given with its epoch: ``(index, epoch)``.

    The epoch travels with the index into the dataset, also into worker processes (which hold
    copies of the dataset made before the epoch is known), so that a training item can depend on it.
    """

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        return ((index, epoch) for index in super().__iter__())


class CaptionDataset(Dataset):
    """Yields one image with its captions: ``{"pixel_values", "caption", "references", "scene", "image_id"}``.

    ``caption`` is the caption to train on: for a training set, one of the image's captions chosen
    by the epoch, a different one each epoch (cycling through them from a start drawn with
    ``seed``); otherwise the first one. ``references`` are all of them. Items are indexed by an
    ``int`` or by the ``(index, epoch)`` of :class:`EpochTaggedSampler` (an ``int`` is epoch 0).

    Args:
        records: the images and their captions.
        image_size: side of the square tensor each image is resized to.
        train: choose the caption by the epoch.
        seed: seed of each image's first caption in training.
        interpolation: how images are resized (see :func:`~vlfuse.data.transforms.preprocess_image`).
    """

    def __init__(
        self, records: Sequence[ImageCaptions], image_size: int, *, train: bool = False, seed: int = 0, interpolation: str = "bilinear"
    ) -> None:
        self.records = records
        self.image_size = image_size
        self.interpolation = check_interpolation(interpolation)
        self.train = train
        self.first_caption = np.random.default_rng(seed).integers(0, 2**31, size=len(records)) if train else None

    def __len__(self) -> int:
        return len(self.records)

    def caption_index(self, index: int, epoch: int) -> int:
        """Which of record ``index``'s captions is trained on in ``epoch``."""
        if self.first_caption is None:
            return 0
        return int(self.first_caption[index] + epoch) % len(self.records[index].captions)

    def __getitem__(self, key: Union[int, tuple[int, int]]) -> dict:
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        record = self.records[index]
        return {
            "pixel_values": preprocess_image(record.image, self.image_size, self.interpolation),
            "caption": record.captions[self.caption_index(index, epoch)],
            "references": list(record.captions),
            "scene": record.scene,
            "image_id": record.image_id,
        }


def collate_captions(items: list[dict]) -> dict:
    """Batch :class:`CaptionDataset` items.

    Returns:
        ``pixel_values`` (B, 3, S, S) float in [0, 1]; ``captions`` (B strings, one per image);
        ``references`` (B lists of strings); ``scenes`` (B scenes, or ``None`` unless every image
        has one); ``image_ids`` (B).
    """
    scenes = [item["scene"] for item in items]
    return {
        "pixel_values": torch.stack([item["pixel_values"] for item in items]),
        "captions": [item["caption"] for item in items],
        "references": [item["references"] for item in items],
        "scenes": scenes if all(scene is not None for scene in scenes) else None,
        "image_ids": [item["image_id"] for item in items],
    }
