"""The bilinear answer classifier: the pooled classifier plus a small MLP over products of the
pooled state's features (the default head)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from vlfuse.heads.base import HEADS, grow_rows
from vlfuse.heads.pooled import PooledConfig, PooledHead

PRODUCT_FEATURES = 32
"""Hidden units of :class:`BilinearHead`: each a learnt quadratic form of the pooled state."""


class QuadraticForms(nn.Module):
    """``count`` quadratic forms of a vector: ``y_k = h^T W_k h`` for ``h`` ``(B, dim)`` -> ``(B, count)``.

    What ``nn.Bilinear(dim, dim, count, bias=False)`` computes on ``(h, h)``, with the same
    ``weight`` ``(count, dim, dim)``, as one matrix product: ``nn.Bilinear``'s CPU kernel took
    about 10x longer for a training step of the easy-VQA default (forward and backward, 320
    questions, width 128, 32 forms).
    """

    def __init__(self, dim: int, count: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(count, dim, dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        count, dim, _ = self.weight.shape
        left = h @ self.weight.transpose(0, 1).reshape(dim, count * dim)  # (B, count * dim): sum_i h_i W_kij
        return (left.view(-1, count, dim) * h[:, None, :]).sum(-1)  # (B, count)


@HEADS.register
@dataclass
class BilinearConfig(PooledConfig):
    """The bilinear classifier (``type: bilinear``, the default): any answer vocabulary.

    Attributes:
        dropout: dropout on the pooled state, before both classifiers.
    """

    type: str = "bilinear"

    def build(self, dim: int, answers: Sequence[str]) -> "BilinearHead":
        return BilinearHead(dim, len(answers), dropout=self.dropout)


class BilinearHead(PooledHead):
    """The pooled classifier plus an MLP whose hidden units are quadratic forms of the pooled state.

    With ``h`` the normalised mean of the fused question tokens (as in :class:`PooledHead`)::

        z = gelu(h^T P_k h + u_k . h + c_k)   for k = 1..32       (QuadraticForms + nn.Linear)
        scores = W h + b + V z

    Why: "is there a red shape?" is answered by a product, the colour the question names times the
    colour the image shows, both of which ``h`` carries in separate features; a negated question
    flips the answer, an exclusive-or of that product with "is it negated". A linear classifier can
    form neither. The fusion MLPs can, but must grow two random projections together from a start
    where their product is near 0, and on some seeds whole groups of yes/no questions then sit at
    their answer prior for many epochs (docs/results.md, "Why the yes/no groups stall"). Here each
    product has one weight matrix ``P_k``, which starts at 0 (the model starts as the pooled head
    plus a small MLP of ``h``), and the hidden layer gives the exclusive-or.

    Args:
        dim: width of the fused tokens.
        num_answers: answers to score.
        dropout: dropout on the pooled state.
    """

    def __init__(self, dim: int, num_answers: int, *, dropout: float = 0.0) -> None:
        super().__init__(dim, num_answers, dropout=dropout)
        self.products = QuadraticForms(dim, PRODUCT_FEATURES)
        self.linear_features = nn.Linear(dim, PRODUCT_FEATURES)
        self.product_scores = nn.Linear(PRODUCT_FEATURES, num_answers)

    def forward(self, fused: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        norm, drop, linear = self.classifier
        h = drop(norm(self.pool(fused, text_mask)))  # (Bq, dim)
        z = nn.functional.gelu(self.products(h) + self.linear_features(h))  # (Bq, PRODUCT_FEATURES)
        return linear(h) + self.product_scores(z)

    def extend_answers(self, count: int) -> None:
        super().extend_answers(count)
        self.product_scores = grow_rows(self.product_scores, count)
