"""The LightningDataModule shared by every VQA dataset: splits, vocabulary, loaders."""

from __future__ import annotations

import os
import sys
from functools import cached_property
from typing import Container, Iterable, Sequence

import lightning as L
from lightning.pytorch.overrides.distributed import UnrepeatedDistributedSampler
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, Sampler

from vlfuse.data import AnswerVocab, GroupedVQADataset, ImageQuestions, collate_grouped
from vlfuse.data.answers import quoted
from vlfuse.data.resumable import EpochShuffleSampler, ResumableDataLoader

SPLITS = ("train", "val", "test")
STAGE_SPLITS = {"fit": ("train", "val"), "validate": ("val",), "test": ("test",)}
"""The splits each of Lightning's stages reads."""


@rank_zero_only
def _warn(message: str) -> None:
    print(f"vlfuse: warning: {message}", file=sys.stderr)


class VQADataModule(L.LightningDataModule):
    """Base class: a subclass says how to load each split; this class batches them.

    A batch holds ``batch_size`` images with all their questions (see
    :func:`vlfuse.data.collate_grouped`), so each image is encoded once per step. The training
    order of each epoch depends on the run seed and the epoch only, and the training loader's
    place in the epoch is saved in checkpoints (:class:`vlfuse.data.resumable.ResumableDataLoader`),
    so a resumed run sees the batches the uninterrupted run would have seen.

    Args:
        batch_size: images per batch (each brings all its questions).
        image_size: side the images are resized to; ``None`` takes the model's.
        num_workers: DataLoader worker processes.
        limit_images: keep only the first N images of each split (quick runs and tests); ``None``
            keeps them all.
        seed: seed of any random split a subclass makes, and of the training order when no run
            seed is set (``seed_everything``, whose seed takes precedence, as in Lightning's own
            DistributedSampler).
    """

    train_sampler_class: type[EpochShuffleSampler] = EpochShuffleSampler
    """The training sampler (captioning uses a variant that tells the dataset the epoch)."""

    def __init__(
        self,
        batch_size: int = 32,
        image_size: int | None = None,
        num_workers: int = 0,
        limit_images: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if type(self) is VQADataModule:
            raise ValueError(
                "VQADataModule is the base class of the datamodules: give a dataset with --config "
                "configs/easy_vqa.yaml (or any config in configs/) or --data, e.g. --data vlfuse.datamodules.EasyVQADataModule"
            )
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if limit_images is not None and limit_images < 1:
            raise ValueError(f"limit_images must be at least 1 (or null for every image), got {limit_images}")
        self.batch_size = batch_size
        self.image_size = image_size
        self.interpolation = "bilinear"  # the model's image encoder sets its own (vlfuse.lit.agree_image_transform)
        self.stored_features: Container[str] | None = None
        """Image keys whose features the model reads from disk (a feature store, set by the Lightning
        module): a split whose every image is in it is not decoded."""
        self.num_workers = num_workers
        self.limit_images = limit_images
        self.seed = seed
        self._records: dict[str, list[ImageQuestions]] = {}
        self._model_vocab: AnswerVocab | None = None  # a model's answers, see use_answers
        self._split_vocabs: dict[str, AnswerVocab] = {}

    def load_records(self, split: str) -> list[ImageQuestions]:
        """Every image of ``split`` ('train', 'val' or 'test') with its questions and answers."""
        raise NotImplementedError

    def build_vocab(self, train: list[ImageQuestions]) -> AnswerVocab:
        """The answer vocabulary; by default every training answer, most frequent first."""
        return AnswerVocab.most_common(a for r in train for a in r.answers)

    def records(self, split: str) -> list[ImageQuestions]:
        """The (cached, possibly limited) records of ``split``."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
        if split not in self._records:
            # The training split is loaded once, for the vocabulary and for training alike.
            records = self._all_train_records if split == "train" else self.load_records(split)
            self._records[split] = records[: self.limit_images] if self.limit_images else records
        return self._records[split]

    def check_splits(self, stages: Iterable[str]) -> None:
        """Load every split that ``stages`` ('fit', 'validate', 'test') will read, so that a missing or
        bad one stops the run now: ``vlfuse fit`` asks this before training, for the test split too when
        it will test after fitting. The records are kept for the run."""
        for stage in stages:
            for split in STAGE_SPLITS[stage]:
                self.records(split)

    @cached_property
    def _all_train_records(self) -> list[ImageQuestions]:
        """The whole training split, ignoring ``limit_images``: the vocabulary comes from all of it."""
        return self.load_records("train")

    @cached_property
    def data_vocab(self) -> AnswerVocab:
        """The data's own answer classes: :meth:`build_vocab` of the whole training split."""
        return self.build_vocab(self._all_train_records)

    @property
    def vocab(self) -> AnswerVocab:
        """The answer classes the labels index: a model's (:meth:`use_answers`), else :attr:`data_vocab`."""
        return self._model_vocab or self.data_vocab

    @property
    def answers(self) -> list[str]:
        return self.vocab.answers

    def use_answers(self, answers: Sequence[str]) -> None:
        """Label the questions with ``answers``, a model's vocabulary, matched by name: the data's
        answers may be the same set in another order, or a subset. Each split's answers that the
        model does not know get labels past its answers, which it never predicts (see :meth:`split_vocab`)."""
        self._model_vocab = AnswerVocab(answers)
        self._split_vocabs = {}

    def split_vocab(self, split: str) -> AnswerVocab:
        """The vocabulary that labels ``split``: :attr:`vocab`, then, with a model's answers
        (:meth:`use_answers`), the split's answers outside them, said in one line the first time:
        the loss leaves those questions out and accuracy counts them wrong."""
        if self._model_vocab is None:
            return self.vocab
        if split not in self._split_vocabs:
            answers = self.split_answers(split)
            vocab = self._model_vocab.extended(answers)
            unknown = vocab.answers[len(self._model_vocab):]
            if unknown:
                outside = sum(a not in self._model_vocab for a in answers)
                _warn(
                    f"{outside} of the {len(answers)} {split} questions have an answer outside the model's "
                    f"{len(self._model_vocab)} ({quoted(unknown)}): counted wrong"
                )
            self._split_vocabs[split] = vocab
        return self._split_vocabs[split]

    def split_sizes(self, split: str) -> dict[str, int]:
        """The images of ``split`` and its questions (or captions), as a model card states them."""
        records = self.records(split)
        sizes = {"images": len(records)}
        for items in ("questions", "captions"):
            if records and hasattr(records[0], items):
                sizes[items] = sum(len(getattr(r, items)) for r in records)
        return sizes

    def split_answers(self, split: str) -> list[str]:
        """Every answer of ``split``, one per question (those of its records)."""
        return [a for r in self.records(split) for a in r.answers]

    @property
    def train_questions(self) -> list[str]:
        """Every training question, e.g. to build a word-level tokenizer."""
        return [q for r in self._all_train_records for q in r.questions]

    def dataset(self, split: str) -> GroupedVQADataset:
        if self.image_size is None:
            raise ValueError("image_size is not set: give data.image_size or let the model set it")
        dataset = GroupedVQADataset(self.records(split), self.split_vocab(split), self.image_size, interpolation=self.interpolation)
        if self.stored_features is not None:
            dataset.decode_only_uncached(self.stored_features)
        return dataset

    def _eval_sampler(self, split: str, dataset: GroupedVQADataset) -> Sampler | None:
        """Under a multi-process trainer, each rank's share of an evaluation split: every image
        once, none repeated (Lightning's DistributedSampler would repeat images to even the ranks
        out, and the metrics would count them twice); ranks may get one image more than others."""
        kwargs = self.trainer.distributed_sampler_kwargs if self.trainer is not None else None
        if not kwargs or kwargs["num_replicas"] < 2:
            return None
        if len(dataset) < kwargs["num_replicas"]:
            raise ValueError(
                f"the {split} split has {len(dataset)} images, fewer than the {kwargs['num_replicas']} processes "
                "(trainer.devices x trainer.num_nodes) that evaluate it"
            )
        return UnrepeatedDistributedSampler(dataset, shuffle=False, **kwargs)

    def _loader_options(self) -> dict:
        """The DataLoader options of every split. Workers start anew each pass over the data
        (``persistent_workers`` false): they see the dataset as it is then (a frozen encoder that has
        cached every image turns decoding off, :meth:`GroupedVQADataset.decode_only_uncached`), and
        each pass draws the one random number a new loader iterator takes from torch's generator, as
        without workers, so that a run trains the same with any number of them."""
        return dict(batch_size=self.batch_size, num_workers=self.num_workers, collate_fn=collate_grouped)

    def _loader(self, split: str) -> DataLoader:
        """An evaluation split in order (this rank's share of it under DDP)."""
        dataset = self.dataset(split)
        return DataLoader(dataset, shuffle=False, sampler=self._eval_sampler(split, dataset), **self._loader_options())

    def train_dataloader(self) -> ResumableDataLoader:
        """The shuffled training batches: this rank's share of an order fixed by the seed and the epoch."""
        dataset = self.dataset("train")
        seed = int(os.environ.get("PL_GLOBAL_SEED", self.seed))  # set by seed_everything
        trainer = self.trainer
        replicas = dict(num_replicas=trainer.world_size, rank=trainer.global_rank) if trainer is not None else {}
        sampler = self.train_sampler_class(dataset, seed=seed, **replicas)
        return ResumableDataLoader(dataset, sampler, **self._loader_options())

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")
