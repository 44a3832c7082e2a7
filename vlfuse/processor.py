"""The processor: a model's tokenizer and image transform in one object, saved and loaded with the model.

It turns what users and data loaders hold into what the model's :meth:`~vlfuse.model.VLFuseModel.forward`
takes (:class:`ModelInputs`), in one place for training, inference, analysis, pruning, the scripts and
the tests:

- ``processor(images=..., questions=...)``: images (paths, PIL images, numpy arrays, torch tensors) and questions,
  each distinct image loaded and resized once (:func:`vlfuse.data.preprocess_image`, the transform
  training used) and shared through ``image_index``;
- :meth:`VLFuseProcessor.batch`: a batch of :func:`vlfuse.data.collate_grouped` (whose images the
  dataset has already transformed), moved to a device.

Normalising pixels belongs to the image encoder, which knows the statistics it expects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Hashable, Iterator, Mapping, Sequence

import numpy as np
import torch
from PIL import Image

from vlfuse.data import ImageSource, preprocess_image
from vlfuse.data.transforms import check_interpolation
from vlfuse.encoders import TokenCache


@dataclass
class ModelInputs(Mapping):
    """What a model's ``forward`` takes: ``model(**inputs)``.

    Attributes:
        pixel_values: ``(Bi, 3, S, S)`` images in [0, 1], or ``None`` when a frozen encoder's
            cache holds them all (see ``image_keys``).
        input_ids: ``(Bq, Lt)`` token ids.
        attention_mask: ``(Bq, Lt)`` 1 for real tokens, 0 for padding.
        image_index: ``(Bq,)`` the image of each question, or ``None`` for question i about image i.
        image_keys: a name per image, for a frozen image encoder's feature cache, or ``None``.
    """

    pixel_values: torch.Tensor | None
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    image_index: torch.Tensor | None = None
    image_keys: list[str | None] | None = None

    def __getitem__(self, key: str):
        if key not in self.__dataclass_fields__:
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(spec.name for spec in fields(self))

    def __len__(self) -> int:
        return len(fields(self))

    def to(self, device: str | torch.device | None = None, dtype: torch.dtype | None = None) -> "ModelInputs":
        """The inputs on ``device``, the pixels in ``dtype`` (token ids and indices keep theirs)."""
        move = (lambda t: None if t is None else t.to(device))
        pixels = None if self.pixel_values is None else self.pixel_values.to(device, dtype)
        return ModelInputs(pixels, move(self.input_ids), move(self.attention_mask), move(self.image_index), self.image_keys)


class VLFuseProcessor:
    """A model's tokenizer and image transform: raw images and questions -> :class:`ModelInputs`.

    Args:
        tokenizer: a transformers tokenizer (a word-level one built from the training questions,
            :func:`vlfuse.encoders.build_word_tokenizer`, or a pretrained encoder's own).
        image_size: the side images are resized to.
        max_length: the longest text in tokens; longer ones are truncated.
        interpolation: how images are resized (one of :data:`vlfuse.data.transforms.INTERPOLATIONS`),
            as in training: the image encoder's ``interpolation``.

    Attributes:
        token_cache: each distinct text's tokens, kept by :meth:`tokenize` with ``cache=True``
            (training repeats the same questions every epoch; the tokenizer took about 4% of an
            easy-VQA training step).
    """

    def __init__(self, tokenizer, *, image_size: int, max_length: int, interpolation: str = "bilinear") -> None:
        self.tokenizer = tokenizer
        self.image_size = image_size
        self.interpolation = check_interpolation(interpolation)
        self.max_length = max_length
        self.token_cache = TokenCache(self._tokenize, tokenizer.pad_token_id, tokenizer.padding_side)

    def tokenize(self, texts: Sequence[str], *, cache: bool = False) -> dict[str, torch.Tensor]:
        """Texts -> ``input_ids`` and ``attention_mask`` ``(B, Lt)``, padded to the longest, at most
        ``max_length`` tokens; ``cache`` tokenizes each distinct text once (:attr:`token_cache`)."""
        return self.token_cache(texts) if cache else self._tokenize(texts)

    def _tokenize(self, texts: Sequence[str]) -> dict[str, torch.Tensor]:
        encoded = self.tokenizer(
            list(texts),
            padding=True,
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
            return_token_type_ids=False,
        )
        return {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}

    def image(self, source: ImageSource) -> torch.Tensor:
        """One image (a path, a PIL image, a numpy array or a torch tensor: :func:`vlfuse.data.transforms.array_to_image`)
        as the model sees it: ``(3, S, S)`` in [0, 1].

        Raises:
            vlfuse.data.ImageLoadError: the image cannot be read (the message names the file).
        """
        return preprocess_image(source, self.image_size, self.interpolation)

    def __call__(
        self, images: Sequence[ImageSource], questions: Sequence[str], *, cache: bool = False
    ) -> ModelInputs:
        """``questions[i]`` about ``images[i]``: each distinct image (the same path, or the same
        object) is loaded once, and the questions about it share it through ``image_index``."""
        if isinstance(questions, str) or isinstance(images, (str, os.PathLike, Image.Image)):
            raise ValueError("images and questions must be sequences (one image per question), not a single item")
        if len(images) != len(questions):
            raise ValueError(f"need one image per question: got {len(images)} images and {len(questions)} questions")
        images = list(images)  # kept alive: an array or tensor is known by its id (a batch's rows are new objects)
        slots: dict[Hashable, int] = {}
        pixels = []
        for image in images:
            key = image_key(image)
            if key not in slots:
                slots[key] = len(pixels)
                pixels.append(self.image(image))
        image_index = torch.tensor([slots[image_key(image)] for image in images], dtype=torch.long)  # (Bq,)
        tokens = self.tokenize(questions, cache=cache)
        return ModelInputs(torch.stack(pixels) if pixels else None, **tokens, image_index=image_index)

    def batch(
        self,
        batch: Mapping,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        *,
        cache: bool = False,
    ) -> ModelInputs:
        """A :func:`vlfuse.data.collate_grouped` batch (``pixel_values``, ``questions``, ``image_index``,
        ``image_keys``) as model inputs on ``device``, the pixels in ``dtype``."""
        tokens = self.tokenize(batch["questions"], cache=cache)
        inputs = ModelInputs(batch["pixel_values"], **tokens, image_index=batch["image_index"], image_keys=batch.get("image_keys"))
        return inputs.to(device, dtype)


def image_key(image: ImageSource) -> Hashable:
    """What identifies an image: its absolute path, or the object itself (the caller keeps it alive,
    so ids are not reused)."""
    if isinstance(image, (str, os.PathLike)):
        return os.path.abspath(os.fspath(image))
    if isinstance(image, (Image.Image, np.ndarray, torch.Tensor)):
        return id(image)
    raise ValueError(f"image must be a file path, a PIL image, a numpy array or a torch tensor, got {type(image).__name__}")
