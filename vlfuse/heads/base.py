"""The answer-head interface and its registry: what turns the fuser's output into answer scores."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Sequence

import torch
from torch import nn

from vlfuse.parts import TOKENS, PartConfig, Registry

HEADS: Registry = Registry("head", default="bilinear")
"""The answer heads a model config can name (``head: {type: ...}``), by type."""


@dataclass
class HeadConfig(PartConfig):
    """Base of an answer head's config (see :mod:`vlfuse.parts`); ``build`` makes the head.

    Class attributes:
        reads: what it reads of the fuser (:data:`~vlfuse.parts.TOKENS` or
            :data:`~vlfuse.parts.EVIDENCE`); the model refuses a fuser that gives another.
    """

    reads: ClassVar[str] = TOKENS

    def check(self, answers: Sequence[str]) -> None:
        """Raise a ``ValueError`` naming what of ``answers`` this head cannot work with."""

    def build(self, dim: int, answers: Sequence[str]) -> "Head":
        """The head, over fused tokens of width ``dim``, scoring ``answers``."""
        raise NotImplementedError


class Head(nn.Module):
    """Turns what the fuser gives into answer scores: the last part of :class:`~vlfuse.model.VLFuseModel`.

    Chosen by the ``type`` of its config (:data:`HEADS`).
    """

    def forward(self, fused: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """Answer scores ``(Bq, num_answers)``.

        Args:
            fused: the fuser's output: ``(Bq, Lt, dim)`` tokens, or ``(Bq,)`` evidence.
            text_mask: ``(Bq, Lt)`` True for real (non-padding) question tokens.
        """
        raise NotImplementedError

    def extend_answers(self, count: int) -> None:
        """Score ``count`` more answers, after the others: new output rows, initialised as the head
        initialises its rows; the old rows keep their weights exactly."""
        raise NotImplementedError


def grow_rows(linear: nn.Linear, count: int) -> nn.Linear:
    """``linear`` with ``count`` more output rows: its own rows copied exactly, the new ones
    initialised as ``nn.Linear`` initialises them (on the same device, of the same dtype)."""
    weight = linear.weight
    grown = nn.Linear(linear.in_features, linear.out_features + count, bias=linear.bias is not None,
                      device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        grown.weight[: linear.out_features] = weight
        if linear.bias is not None:
            grown.bias[: linear.out_features] = linear.bias
    return grown.requires_grad_(weight.requires_grad)
