"""The bilinear answer classifier: the pooled readout plus a small MLP over products of the pooled
state's features."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from vlfuse.readouts.base import register_readout
from vlfuse.readouts.pool import PoolReadout

PRODUCT_FEATURES = 32
"""Hidden units of :class:`BilinearReadout`: each a learnt quadratic form of the pooled state."""


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


@register_readout
class BilinearReadout(PoolReadout):
    """The ``pool`` classifier plus an MLP whose hidden units are quadratic forms of the pooled state.

    With ``h`` the normalised mean of the fused question tokens (as in ``pool``)::

        z = gelu(h^T P_k h + u_k . h + c_k)   for k = 1..32       (QuadraticForms + nn.Linear)
        scores = W h + b + V z

    Why: "is there a red shape?" is answered by a product, the colour the question names times the
    colour the image shows, both of which ``h`` carries in separate features; a negated question
    flips the answer, an exclusive-or of that product with "is it negated". A linear classifier can
    form neither. The fusion MLPs can, but must grow two random projections together from a start
    where their product is near 0, and on some seeds whole groups of yes/no questions then sit at
    their answer prior for many epochs (docs/results.md, "Why the yes/no groups stall"). Here each
    product has one weight matrix ``P_k``, which starts at 0 (the model starts as ``pool`` plus a
    small MLP of ``h``), and the hidden layer gives the exclusive-or.

    Selected by ``readout: bilinear``. Reads ``dropout`` besides the fusion options.
    """

    name = "bilinear"
    format_v1_keys = {}

    def __init__(self, config, answers: Sequence[str], *, text_width: int, grid_size: tuple[int, int]) -> None:
        super().__init__(config, answers, text_width=text_width, grid_size=grid_size)
        d = config.fusion_dim
        self.products = QuadraticForms(d, PRODUCT_FEATURES)
        self.linear_features = nn.Linear(d, PRODUCT_FEATURES)
        self.product_scores = nn.Linear(PRODUCT_FEATURES, len(answers))

    def forward(
        self, tokens: torch.Tensor, text_mask: torch.Tensor, image_context: Any = None, image_index=None
    ) -> torch.Tensor:
        norm, drop, linear = self.classifier
        h = drop(norm(self.pool(tokens, text_mask)))  # (Bq, fusion_dim)
        z = nn.functional.gelu(self.products(h) + self.linear_features(h))  # (Bq, PRODUCT_FEATURES)
        return linear(h) + self.product_scores(z)
