"""Training from streaming shards (``vlfuse convert``): Lightning's ``litdata``, local or in object storage."""

from __future__ import annotations

import os
from collections import Counter
from functools import cached_property
from typing import Any, Iterable

import torch
from torch.utils.data import Dataset

from vlfuse.data import AnswerVocab, ImageQuestions, collate_grouped
from vlfuse.datamodules.base import SPLITS, STAGE_SPLITS, VQADataModule

MISSING = "StreamingDataModule needs litdata: pip install 'vlfuse[stream]'"


def _streaming():
    """:mod:`vlfuse.data.streaming`, which imports litdata, imported when first needed."""
    try:
        from vlfuse.data import streaming
    except ModuleNotFoundError as err:
        if err.name != "litdata":
            raise
        raise ValueError(MISSING) from None
    return streaming


class StreamingDataModule(VQADataModule):
    """VQA data from the shards ``vlfuse convert`` writes (litdata optimized chunks, one item per
    image with all its questions), in a local folder or at an object-store URL (``s3://bucket/path``).

    Training streams the shuffled chunks with litdata's ``StreamingDataset`` and
    ``StreamingDataLoader``: shuffled by litdata with the run seed (``seed_everything``, else
    ``seed``) and the epoch, shared among DDP processes by litdata (the trainer's world size and rank),
    and resumable mid-epoch (the loader's ``state_dict``, which Lightning saves in checkpoints).
    Validation and test read their split in order, each DDP process its share, every image once.
    Images are decoded from their stored bytes exactly as the image files are, and batches are those
    of the other datamodules (:func:`~vlfuse.data.collate_grouped`). The vocabulary and the training
    questions come from the shards' index, so nothing is read up front.

    Args:
        data_dir: the shard folder, or its URL (``s3://``, ``gs://``, ``azure://``, ``r2://``).
        cache_dir: for a URL: the local folder litdata downloads chunks into (required there; a local
            folder is read in place).
        storage_options: for a URL: litdata's connection options (credentials, endpoint), passed as given.
        **kwargs: see :class:`VQADataModule` (``limit_images``: each split's first images in the shards).
    """

    def __init__(
        self,
        data_dir: str,
        cache_dir: str | None = None,
        storage_options: dict[str, Any] | None = None,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        self.data_dir = str(data_dir)
        self.cache_dir = cache_dir
        self.storage_options = dict(storage_options or {})

    @cached_property
    def index(self) -> dict[str, Any]:
        """The shards' checked index (:data:`vlfuse.data.streaming.INDEX_NAME`)."""
        return _streaming().read_index(self.data_dir, self.cache_dir, self.storage_options)

    def has_split(self, split: str) -> bool:
        """Whether the shards hold ``split``."""
        return split in self.index["splits"]

    def check_splits(self, stages: Iterable[str]) -> None:
        """Read the index and check that every split ``stages`` read is there, before training."""
        for stage in stages:
            for split in STAGE_SPLITS[stage]:
                if not self.has_split(split):
                    raise ValueError(f"the shards in {self.data_dir} have no {split} split (they have {', '.join(self.index['splits'])})")

    def load_records(self, split: str) -> list[ImageQuestions]:
        raise ValueError(f"StreamingDataModule streams its splits from {self.data_dir}: it keeps no records in memory")

    @cached_property
    def data_vocab(self) -> AnswerVocab:
        """The answer classes of the data the shards were converted from (their index's)."""
        return AnswerVocab(self.index["answers"])

    @property
    def train_questions(self) -> list[str]:
        """Every training question, as many times as it is asked (from the index's counts)."""
        return [question for question, count in self.index["train_questions"] for _ in range(count)]

    def split_answers(self, split: str) -> list[str]:
        counts = Counter(self._split_entry(split)["answers"])
        return list(counts.elements())

    def split_sizes(self, split: str) -> dict[str, int]:
        """The images and questions of ``split`` read (from the index; under ``limit_images``, counted)."""
        entry = self._split_entry(split)
        if self._size(split) == entry["images"]:
            return {"images": entry["images"], "questions": entry["questions"]}
        stream = self._open(split, decode=False)
        decoder = _streaming().ShardDecoder(self.data_vocab, 1, "bilinear", self.data_dir)  # reads the questions only
        questions = sum(len(decoder.record(stream[i])[0].questions) for i in range(self._size(split)))
        return {"images": self._size(split), "questions": questions}

    def _split_entry(self, split: str) -> dict[str, Any]:
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        if not self.has_split(split):
            raise ValueError(f"the shards in {self.data_dir} have no {split} split (they have {', '.join(self.index['splits'])})")
        return self.index["splits"][split]

    def _decoder(self, split: str) -> Any:
        if self.image_size is None:
            raise ValueError("image_size is not set: give data.image_size or let the model set it")
        where = f"{self.data_dir} ({split})"
        return _streaming().ShardDecoder(self.split_vocab(split), self.image_size, self.interpolation, where)

    def _size(self, split: str) -> int:
        """The images of ``split`` read: all, or the first ``limit_images``."""
        images = self._split_entry(split)["images"]
        return images if self.limit_images is None else min(images, self.limit_images)

    def _open(self, split: str, *, seed: int = 0, limit: bool = False, decode: bool = True) -> Any:
        """``split`` as a litdata dataset: its items decoded and labelled, or (``decode`` false) as stored."""
        return _streaming().open_split(
            self.data_dir,
            split,
            self._decoder(split) if decode else None,
            seed=seed,
            limit=self.limit_images if limit else None,
            size=self._split_entry(split)["images"],
            cache_dir=self.cache_dir,
            storage_options=self.storage_options,
        )

    def dataset(self, split: str) -> Dataset:
        """``split`` in order, by index (evaluation): a map-style dataset of its images."""
        return _streaming().ShardSplit(self._open(split), self._size(split))

    def train_dataloader(self) -> Any:
        """litdata's ``StreamingDataLoader`` over the shuffled training chunks (this process's share)."""
        import litdata

        seed = int(os.environ.get("PL_GLOBAL_SEED", self.seed))  # set by seed_everything
        stream = self._open("train", seed=seed, limit=True)
        # A generator of its own: each pass's one draw (the workers' base seed) leaves torch's global
        # generator, hence dropout, as a resumed run restores it (see vlfuse.data.resumable).
        generator = torch.Generator().manual_seed(seed)
        return litdata.StreamingDataLoader(
            stream, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers, collate_fn=collate_grouped,
            generator=generator,
        )
