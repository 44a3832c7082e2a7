"""SHAPES as a LightningDataModule: generated training images, the released val split, no test."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vlfuse.data import AnswerVocab, ImageQuestions
from vlfuse.data.shapes import (
    ANSWERS,
    OFFICIAL_IMAGES_PER_QUESTION,
    ShapesSplit,
    distinct_queries,
    generate_training_set,
    load_released_split,
    read_questions,
    to_english,
)
from vlfuse.datamodules.base import VQADataModule

logger = logging.getLogger(__name__)

SHAPES_DIR_ENV = "VLFUSE_SHAPES_DIR"
"""Environment variable naming the folder of the released SHAPES files."""
TRAINING_QUESTIONS_SPLIT = "train.large"
"""The released file whose 212 distinct questions are the training questions."""


def find_shapes_dir(data_dir: str | Path | None = None) -> Path:
    """The folder of the released SHAPES files.

    ``data_dir`` when given; else ``$VLFUSE_SHAPES_DIR``, then ``../shared/data/shapes`` relative to
    the current directory, whichever is a folder first.

    Raises:
        FileNotFoundError: naming every place looked at.
    """
    if data_dir is not None:
        candidates = [Path(data_dir)]
    else:
        candidates = [Path(os.environ[SHAPES_DIR_ENV])] if os.environ.get(SHAPES_DIR_ENV) else []
        candidates.append(Path.cwd() / ".." / "shared" / "data" / "shapes")
    for candidate in candidates:
        if candidate.is_dir():
            return candidate
    looked = ", ".join(str(c) for c in candidates)
    hint = "" if data_dir is not None else f" (set data_dir or ${SHAPES_DIR_ENV})"
    raise FileNotFoundError(f"SHAPES data folder not found; looked at: {looked}{hint}")


class ShapesDataModule(VQADataModule):
    """SHAPES: compositional questions about 3x3 grids of coloured shapes, answered true or false.

    'train' holds images generated here (:func:`vlfuse.data.shapes.generate_training_set`) for the
    212 distinct questions of the released ``train.large.query``; 'val' is the released val split
    (16 questions, none of them asked in training); 'test' is held out and refused. Questions are
    given in the dataset's English form; :meth:`queries` returns their S-expressions, row for row,
    e.g. to report accuracy by :func:`vlfuse.data.shapes.query_depth`. One question per image.

    Args:
        data_dir: folder of the released files; ``None`` looks at ``$VLFUSE_SHAPES_DIR``, then
            ``../shared/data/shapes`` relative to the current directory.
        images_per_question: generated training images per question. 64 is the official protocol;
            more is the *extra data* variant, whose results are not comparable with published ones.
        generated_seed: seed of the scene generator.
        skip_bad_rows: leave out (and count) released rows with an unparsable query or a bad answer
            instead of raising.
        **kwargs: see :class:`VQADataModule`.
    """

    def __init__(
        self,
        data_dir: str | None = None,
        images_per_question: int = OFFICIAL_IMAGES_PER_QUESTION,
        generated_seed: int = 0,
        skip_bad_rows: bool = False,
        **kwargs,
    ) -> None:
        super().__init__(**kwargs)
        if images_per_question < 1:
            raise ValueError(f"images_per_question must be at least 1, got {images_per_question}")
        self.data_dir = data_dir
        self.images_per_question = images_per_question
        self.generated_seed = generated_seed
        self.skip_bad_rows = skip_bad_rows
        self._splits: dict[str, ShapesSplit] = {}

    @property
    def protocol(self) -> str:
        """``'official'`` (64 images per training question) or a label of the extra-data variant."""
        if self.images_per_question == OFFICIAL_IMAGES_PER_QUESTION:
            return "official"
        return f"extra data ({self.images_per_question} images per training question)"

    def _split(self, split: str) -> ShapesSplit:
        """The (cached) images, S-expressions and answers of 'train' or 'val'."""
        if split == "test":
            raise ValueError(
                "the SHAPES test split is held out and not used by this project: evaluate on 'val'"
            )
        if split not in self._splits:
            data_dir = find_shapes_dir(self.data_dir)
            if split == "train":
                questions = read_questions(data_dir, TRAINING_QUESTIONS_SPLIT, skip_bad_rows=self.skip_bad_rows)
                queries = distinct_queries(questions.queries)
                logger.info("SHAPES training set: %d questions, protocol: %s", len(queries), self.protocol)
                self._splits[split] = generate_training_set(
                    queries, seed=self.generated_seed, images_per_question=self.images_per_question
                )
            else:
                self._splits[split] = load_released_split(data_dir, split, skip_bad_rows=self.skip_bad_rows)
        return self._splits[split]

    def load_records(self, split: str) -> list[ImageQuestions]:
        data = self._split(split)
        return [
            ImageQuestions(image, [to_english(query)], [answer], image_id=f"shapes/{split}/{i}")
            for i, (image, query, answer) in enumerate(zip(data.images, data.queries, data.answers))
        ]

    def queries(self, split: str) -> list[str]:
        """The S-expression of each record's question, aligned with :meth:`records` (limit included)."""
        return self._split(split).queries[: len(self.records(split))]

    def build_vocab(self, train: list[ImageQuestions]) -> AnswerVocab:
        return AnswerVocab(ANSWERS)
