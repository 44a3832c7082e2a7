"""The easy-VQA author's model: a small CNN and a bag of words, multiplied, then an MLP answer head."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


def bag_of_words(input_ids: torch.Tensor, attention_mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Which words of the vocabulary each question holds: (Bq, vocab_size), 1.0 where present.

    Presence, not counts, as the Keras ``Tokenizer.texts_to_matrix`` the author used (mode ``binary``).
    Padding positions (``attention_mask`` 0) count for nothing.
    """
    present = torch.zeros(input_ids.shape[0], vocab_size, device=input_ids.device)
    return present.scatter_(1, input_ids, attention_mask.to(present.dtype)).clamp_(max=1.0)


class BowCNN(nn.Module):
    """The published easy-VQA baseline (V. Zhou and P. Wang, "Easy Visual Question Answering", 2020,
    victorzhou.com/blog/easy-vqa, and the easy-VQA-keras repository).

    Image: Conv(c1, 3x3, same) - MaxPool(2) - Conv(c2, 3x3, same) - MaxPool(2) - Flatten - Dense(width,
    tanh); the convolutions have no activation, as published. Question: bag of words - Dense(width,
    tanh) - Dense(width, tanh). The two vectors are multiplied element-wise, then Dense(width, tanh) and
    a linear layer give the answer logits (softmax in the loss). The weights start as Keras's do
    (Glorot uniform, zero biases). Published: 64x64 images, ``channels=(8, 16)``, ``width=32``, Adam at
    5e-4, 8 epochs of batches of 32 questions: 93.8% on the test split.

    One change from the publication: pixels are centred on ``pixel_mean``, which should be the training
    images' mean (:func:`mean_pixel`), where the author subtracts 0.5. easy-VQA's backgrounds are near
    white (mean 0.9), so with 0.5 every image gives the image layer the same large input; Adam then
    moves its 4,096 weights together and the tanh saturates within a few hundred steps (mean
    pre-activation 6.5), the image vector becomes a constant and the model answers from the question
    alone: 65-66% on 3 of 4 seeds tried, as the unmodified Keras code does (easy-VQA-keras issue 3).

    Args:
        vocab_size: size of the word vocabulary (ids of ``input_ids``).
        num_answers: number of answer classes.
        image_size: side of the square input images.
        width: size of the image vector, the question vector and the hidden answer layer.
        channels: filters of the two convolutions.
        pixel_mean: per-channel value subtracted from the pixels; 0.5 is the author's shift.
    """

    def __init__(
        self,
        vocab_size: int,
        num_answers: int,
        *,
        image_size: int = 64,
        width: int = 32,
        channels: tuple[int, int] = (8, 16),
        pixel_mean: Sequence[float] = (0.5, 0.5, 0.5),
    ) -> None:
        super().__init__()
        if image_size % 4:
            raise ValueError(f"image_size must be a multiple of 4 (two 2x2 poolings), got {image_size}")
        if len(pixel_mean) != 3:
            raise ValueError(f"pixel_mean must hold one value per RGB channel, got {len(pixel_mean)}")
        self.vocab_size = vocab_size
        self.register_buffer("pixel_mean", torch.tensor([float(m) for m in pixel_mean]).view(3, 1, 1), persistent=False)
        c1, c2 = channels
        self.image = nn.Sequential(
            nn.Conv2d(3, c1, 3, padding=1), nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, 3, padding=1), nn.MaxPool2d(2),
            nn.Flatten(),  # (Bi, c2 * (S/4)^2)
            nn.Linear(c2 * (image_size // 4) ** 2, width), nn.Tanh(),
        )
        self.question = nn.Sequential(nn.Linear(vocab_size, width), nn.Tanh(), nn.Linear(width, width), nn.Tanh())
        self.answer = nn.Sequential(nn.Linear(width, width), nn.Tanh(), nn.Linear(width, num_answers))
        for layer in self.modules():
            if isinstance(layer, (nn.Conv2d, nn.Linear)):  # Keras's defaults, as published
                nn.init.xavier_uniform_(layer.weight)
                nn.init.zeros_(layer.bias)

    def forward(
        self, pixel_values: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_index: torch.Tensor
    ) -> torch.Tensor:
        """Answer logits (Bq, num_answers) for images (Bi, 3, S, S) in [0, 1] and questions (Bq, L)."""
        image = self.image(pixel_values - self.pixel_mean)[image_index]  # (Bq, width): each image encoded once
        question = self.question(bag_of_words(input_ids, attention_mask, self.vocab_size))  # (Bq, width)
        return self.answer(image * question)


def mean_pixel(images: Sequence[torch.Tensor]) -> torch.Tensor:
    """The per-channel mean (3,) of ``images``, each (3, S, S) in [0, 1]: :class:`BowCNN`'s ``pixel_mean``."""
    return torch.stack([image.mean(dim=(1, 2)) for image in images]).mean(dim=0)
