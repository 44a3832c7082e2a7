"""The pooled answer classifier: mean of the fused question tokens -> LayerNorm -> Dropout -> Linear."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from vlfuse.heads.base import HEADS, Head, HeadConfig, grow_rows


def masked_mean(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``tokens`` ``(B, L, D)`` over the positions where ``mask`` ``(B, L)`` is True: ``(B, D)``.

    A row with no True position gives zeros.
    """
    weights = mask.unsqueeze(-1).to(tokens.dtype)  # (B, L, 1)
    return (tokens * weights).sum(1) / weights.sum(1).clamp(min=1.0)


@HEADS.register
@dataclass
class PooledConfig(HeadConfig):
    """The pooled classifier (``type: pooled``): any answer vocabulary.

    Attributes:
        dropout: dropout before the linear classifier.
    """

    type: str = "pooled"
    dropout: float = 0.0

    def build(self, dim: int, answers: Sequence[str]) -> "PooledHead":
        return PooledHead(dim, len(answers), dropout=self.dropout)


class PooledHead(Head):
    """The fused question tokens are mean-pooled over the real tokens, then classified by
    ``Linear(Dropout(LayerNorm(pooled)))``.

    Args:
        dim: width of the fused tokens.
        num_answers: answers to score.
        dropout: dropout before the classifier.
    """

    def __init__(self, dim: int, num_answers: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.classifier = nn.Sequential(nn.LayerNorm(dim), nn.Dropout(dropout), nn.Linear(dim, num_answers))

    def pool(self, tokens: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """The question as one vector ``(Bq, dim)``: the mean of its real tokens."""
        return masked_mean(tokens, text_mask)

    def forward(self, fused: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pool(fused, text_mask))

    def extend_answers(self, count: int) -> None:
        self.classifier[-1] = grow_rows(self.classifier[-1], count)
