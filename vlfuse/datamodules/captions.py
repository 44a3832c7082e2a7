"""Captioning data as LightningDataModules: generated SHAPES scenes described by the caption grammar,
and COCO captions (official files or the Karpathy split)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import NamedTuple, Optional, Sequence

import numpy as np
import torch

from vlfuse.captioning.grammar import describe
from vlfuse.data import AnswerVocab
from vlfuse.data.captions import CaptionDataset, EpochTaggedSampler, ImageCaptions, collate_captions
from vlfuse.data.coco_captions import load_coco_captions, load_karpathy_split
from vlfuse.data.shapes import Scene, load_released_split, read_scenes, render_scenes, sample_scenes
from vlfuse.datamodules.base import VQADataModule
from vlfuse.datamodules.shapes import find_shapes_dir

SPLIT_STREAMS = {"train": 0, "val": 1, "test": 2}
"""First word of each split's seed: split streams never coincide, whatever ``seed`` is."""
HELD_APART_SEED = 2026
"""Second word of the validation and test seeds, fixed: these splits are the same in every run."""
RENDER_CHUNK = 1024
"""Scenes drawn at a time (rendering holds float64 cells of the whole chunk)."""


class CaptionDataModule(VQADataModule):
    """Base class of the captioning datamodules: a subclass loads each split's :class:`ImageCaptions`.

    A batch is :func:`~vlfuse.data.captions.collate_captions`'s: ``pixel_values``, ``captions`` (one
    per image: in training chosen by the epoch, a different one each epoch where an image has
    several; else the first), ``references`` (all of them), ``scenes`` and ``image_ids``. Splits,
    ``limit_images``, the resumable training order and DDP evaluation are
    :class:`~vlfuse.datamodules.VQADataModule`'s.
    """

    train_sampler_class = EpochTaggedSampler

    def load_records(self, split: str) -> list[ImageCaptions]:
        """Every image of ``split`` ('train', 'val' or 'test') with its captions."""
        raise NotImplementedError

    @property
    def train_captions(self) -> list[str]:
        """Every caption of every training image (``limit_images`` aside), e.g. to build a tokenizer."""
        return [caption for record in self._all_train_records for caption in record.captions]

    def build_vocab(self, train: list[ImageCaptions]) -> AnswerVocab:
        raise ValueError(f"{type(self).__name__} holds captions, not answers: it has no answer vocabulary")

    def dataset(self, split: str) -> CaptionDataset:
        if self.image_size is None:
            raise ValueError("image_size is not set: give data.image_size or let the model set it")
        return CaptionDataset(self.records(split), self.image_size, train=split == "train", seed=self.seed, interpolation=self.interpolation)

    def _loader_options(self) -> dict:
        return {**super()._loader_options(), "collate_fn": collate_captions}


# ------------------------------------------------------------------------------------- SHAPES


def scene_rng(split: str, seed: int) -> np.random.Generator:
    """The generator of a split's scenes: ``[SPLIT_STREAMS[split], seed]`` seeds it."""
    return np.random.default_rng([SPLIT_STREAMS[split], seed])


def has_objects(scene: Scene) -> bool:
    return any(cell is not None for row in scene for cell in row)


def generate_scenes(count: int, rng: np.random.Generator, exclude: frozenset = frozenset()) -> list[Scene]:
    """``count`` scenes from :func:`~vlfuse.data.shapes.sample_scenes`, leaving out those without
    objects (probability 0.2^9, about 5e-7 each) and those in ``exclude``."""
    scenes: list[Scene] = []
    while len(scenes) < count:
        drawn = sample_scenes(min(count - len(scenes), RENDER_CHUNK), rng)
        scenes += [scene for scene in drawn if has_objects(scene) and scene not in exclude]
    return scenes


class ReleasedCaptions(NamedTuple):
    """Released SHAPES images captioned from the scenes read from their pixels (:func:`released_captions`)."""

    records: list[ImageCaptions]
    rows: int
    """Rows of the split (images, repeats included)."""
    distinct: int
    """Distinct images among them."""
    ambiguous: int
    """Distinct images left out because their reading is not unambiguous."""


def released_captions(data_dir: str | Path | None, split: str) -> ReleasedCaptions:
    """The images of a released SHAPES split, each once, captioned by the grammar from the scene read
    from its pixels (:func:`~vlfuse.data.shapes.read_scenes`).

    An image repeated in the split (one per question) is kept once, at its first row (its id is
    ``shapes/<split>/<row>``); images whose reading is not unambiguous, or whose scene has no
    object, are left out (counted in ``ambiguous``; the released images have none of either).

    Args:
        data_dir: folder of the released files (``None``: see :func:`~vlfuse.datamodules.shapes.find_shapes_dir`).
        split: ``train.tiny``, ``train.small`` or ``val`` (the test split is refused).
    """
    data = load_released_split(find_shapes_dir(data_dir), split)
    first_row: dict[bytes, int] = {}
    for row, image in enumerate(data.images):
        first_row.setdefault(image.tobytes(), row)
    first_rows = list(first_row.values())
    readings = read_scenes(data.images[first_rows])
    records = [
        ImageCaptions(data.images[row], [describe(reading.scene)], image_id=f"shapes/{split}/{row}", scene=reading.scene)
        for row, reading in zip(first_rows, readings)
        if reading.unambiguous and has_objects(reading.scene)
    ]
    return ReleasedCaptions(records, len(data), len(first_rows), len(first_rows) - len(records))


class ShapesCaptionsDataModule(CaptionDataModule):
    """SHAPES scenes (3x3 grids of coloured shapes) captioned by the grammar of
    :mod:`vlfuse.captioning.grammar`, one caption per image; batches carry the scenes, so captions
    can be checked against them (:class:`~vlfuse.captioning.SceneCaptionScores`).

    Scenes come from the package's generator (:func:`~vlfuse.data.shapes.sample_scenes`), less any
    scene without objects; images are rendered from them (30x30, resized to ``image_size``).

    - 'val' and 'test' scenes come from fixed seeds, ``[1, 2026]`` and ``[2, 2026]``
      (:data:`SPLIT_STREAMS`, :data:`HELD_APART_SEED`): the same in every run, for a given count.
    - 'train' scenes come from ``[0, seed]`` and leave out every scene of 'val' and 'test', so no
      held-apart scene is trained on. (Two random scenes are equal with probability 9^-9, so 20,000
      training scenes would share one with 1,500 val and test scenes in about 7% of seeds.) 'val'
      and 'test' are not kept apart from each other.
    - ``released_train_splits`` adds the images of released SHAPES training splits to 'train',
      captioned from the scenes read from their pixels (:func:`released_captions`), each image once
      (``train.tiny`` is the first 64 images of ``train.small``) and ``released_repeats`` times per
      epoch. The released ``val`` split is refused: it measures how captions transfer to the
      released images (``scripts/caption_errors.py --released val``).

    Args:
        num_train_scenes, num_val_scenes, num_test_scenes: generated images of each split.
        released_train_splits: released splits whose images join 'train' (``train.tiny``, ``train.small``).
        released_dir: folder of the released SHAPES files (``None``: ``$VLFUSE_SHAPES_DIR``, then
            ``../shared/data/shapes``).
        released_repeats: how many times each released image is trained on per epoch.
        **kwargs: see :class:`~vlfuse.datamodules.VQADataModule` (``seed`` seeds the training scenes).
    """

    def __init__(
        self,
        num_train_scenes: int = 20000,
        num_val_scenes: int = 500,
        num_test_scenes: int = 1000,
        released_train_splits: Sequence[str] = (),
        released_dir: Optional[str] = None,
        released_repeats: int = 1,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.counts = {"train": num_train_scenes, "val": num_val_scenes, "test": num_test_scenes}
        for split, count in self.counts.items():
            if count < 1:
                raise ValueError(f"num_{split}_scenes must be at least 1, got {count}")
        for split in released_train_splits:
            if not split.startswith("train."):
                raise ValueError(
                    f"released_train_splits: {split!r} is not a released training split (train.tiny, train.small); "
                    "the released val images measure transfer and are never trained on"
                )
        if released_repeats < 1:
            raise ValueError(f"released_repeats must be at least 1, got {released_repeats}")
        self.released_train_splits = list(released_train_splits)
        self.released_dir = released_dir
        self.released_repeats = released_repeats
        self._scenes: dict[str, tuple[list[Scene], np.ndarray]] = {}

    def scenes(self, split: str) -> tuple[list[Scene], np.ndarray]:
        """The (cached) generated scenes of ``split`` and their RGB uint8 images (N, 30, 30, 3)."""
        if split not in self._scenes:
            held_apart = split != "train"
            rng = scene_rng(split, HELD_APART_SEED if held_apart else self.seed)
            exclude = frozenset() if held_apart else frozenset(self.scenes("val")[0] + self.scenes("test")[0])
            scenes = generate_scenes(self.counts[split], rng, exclude)
            images = np.concatenate(
                [render_scenes(scenes[i : i + RENDER_CHUNK], rng) for i in range(0, len(scenes), RENDER_CHUNK)]
            )
            self._scenes[split] = (scenes, images)
        return self._scenes[split]

    @cached_property
    def released_train_records(self) -> list[ImageCaptions]:
        """The images of ``released_train_splits``, each once, captioned from their read scenes."""
        seen: dict[bytes, ImageCaptions] = {}
        for split in self.released_train_splits:
            for record in released_captions(self.released_dir, split).records:
                seen.setdefault(record.image.tobytes(), record)
        return list(seen.values())

    def load_records(self, split: str) -> list[ImageCaptions]:
        scenes, images = self.scenes(split)
        records = [
            ImageCaptions(image, [describe(scene)], image_id=f"shapes-captions/{split}/{i}", scene=scene)
            for i, (scene, image) in enumerate(zip(scenes, images))
        ]
        if split == "train":
            records += self.released_train_records * self.released_repeats
        return records


# --------------------------------------------------------------------------------------- COCO


class CocoCaptionsDataModule(CaptionDataModule):
    """COCO captions (or any data in their layout), several captions per image.

    With ``karpathy_split``, the splits are those of the Karpathy split file: 'train' is its train
    and restval images, 'val' and 'test' its val and test; each image lies at
    ``<data_dir>/<filepath>/<filename>``. Without it, the official annotation files are read:
    'train' is ``train_split`` less ``val_fraction`` of its images, held out (chosen with ``seed``)
    as 'val'; 'test' is ``test_split`` (the official test captions are not public). File locations
    are patterns formatted with the official split name, relative to ``data_dir``.

    Args:
        data_dir: root folder of the files.
        karpathy_split: the Karpathy split file (``dataset_coco.json``), relative to ``data_dir``
            or absolute; ``None`` reads the official annotation files.
        annotations_file: pattern of an official annotations file.
        image_dir: pattern of an official split's image folder.
        train_split: official split trained on.
        test_split: official split tested on.
        val_fraction: share of the training images held out for validation (official files only).
        **kwargs: see :class:`~vlfuse.datamodules.VQADataModule`.
    """

    def __init__(
        self,
        data_dir: str,
        karpathy_split: str | None = None,
        annotations_file: str = "annotations/captions_{split}.json",
        image_dir: str = "{split}",
        train_split: str = "train2014",
        test_split: str = "val2014",
        val_fraction: float = 0.05,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        self.data_dir = Path(data_dir)
        self.karpathy_split = karpathy_split
        self.annotations_file = annotations_file
        self.image_dir = image_dir
        self.train_split = train_split
        self.test_split = test_split
        self.val_fraction = val_fraction

    def load_official(self, split: str) -> list[ImageCaptions]:
        """Every captioned image of an official split (``train2014``, ``val2014``, ...)."""
        return load_coco_captions(
            self.data_dir / self.annotations_file.format(split=split), self.data_dir / self.image_dir.format(split=split)
        )

    @cached_property
    def _karpathy(self) -> dict[str, list[ImageCaptions]]:
        return load_karpathy_split(self.data_dir / self.karpathy_split, self.data_dir)

    @cached_property
    def _train_and_val(self) -> tuple[list[ImageCaptions], list[ImageCaptions]]:
        images = self.load_official(self.train_split)
        order = torch.randperm(len(images), generator=torch.Generator().manual_seed(self.seed)).tolist()
        held_out = set(order[: round(len(images) * self.val_fraction)])
        return [r for i, r in enumerate(images) if i not in held_out], [r for i, r in enumerate(images) if i in held_out]

    def load_records(self, split: str) -> list[ImageCaptions]:
        if self.karpathy_split is not None:
            splits = self._karpathy
            return splits["train"] + splits["restval"] if split == "train" else splits[split]
        if split == "test":
            return self.load_official(self.test_split)
        train, val = self._train_and_val
        return train if split == "train" else val
