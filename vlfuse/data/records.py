"""The unit of every VQA dataset in vlfuse: one image and the questions asked about it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Union

import numpy as np
from PIL import Image

ImageSource = Union[str, Path, Image.Image, np.ndarray]
"""A path to an image file, a PIL image, or an RGB ``uint8`` array of shape (H, W, 3)."""


@dataclass
class ImageQuestions:
    """One image with every question asked about it (answers may be empty at inference).

    Grouping questions by image lets the model encode each image once per batch.
    """

    image: ImageSource
    questions: list[str]
    answers: list[str] = field(default_factory=list)
    image_id: str = ""
    human_answers: list[list[str]] = field(default_factory=list)
    """Optional: every annotator's answer to each question (VQA v2 has ten), for soft accuracy."""

    def __post_init__(self) -> None:
        if self.answers and len(self.answers) != len(self.questions):
            raise ValueError(
                f"image {self.image_id!r}: {len(self.questions)} questions but {len(self.answers)} answers"
            )
        if self.human_answers and len(self.human_answers) != len(self.questions):
            raise ValueError(
                f"image {self.image_id!r}: {len(self.questions)} questions but {len(self.human_answers)} human answer lists"
            )
