"""The pooled answer classifier: mean of the fused question tokens -> LayerNorm -> Dropout -> Linear."""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from vlfuse.readouts.base import Readout, register_readout


def masked_mean(tokens: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``tokens`` ``(B, L, D)`` over the positions where ``mask`` ``(B, L)`` is True: ``(B, D)``.

    A row with no True position gives zeros.
    """
    weights = mask.unsqueeze(-1).to(tokens.dtype)  # (B, L, 1)
    return (tokens * weights).sum(1) / weights.sum(1).clamp(min=1.0)


@register_readout
class PoolReadout(Readout):
    """Any answer vocabulary: the fused question tokens are mean-pooled over the real tokens, then
    classified by ``Linear(Dropout(LayerNorm(pooled)))``.

    Selected by ``readout: pool`` (the default). Reads ``dropout`` besides the fusion options.
    """

    name = "pool"
    options = ("dropout",)
    format_v1_keys = {"head.": "readout.classifier."}

    def __init__(self, config, answers: Sequence[str], *, text_width: int, grid_size: tuple[int, int]) -> None:
        super().__init__(config, answers, text_width=text_width, grid_size=grid_size)
        d = config.fusion_dim
        self.classifier = nn.Sequential(nn.LayerNorm(d), nn.Dropout(config.dropout), nn.Linear(d, len(answers)))

    def pool(self, tokens: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """The question as one vector ``(Bq, fusion_dim)``: the mean of its real tokens."""
        return masked_mean(tokens, text_mask)

    def forward(
        self, tokens: torch.Tensor, text_mask: torch.Tensor, image_context: Any = None, image_index=None
    ) -> torch.Tensor:
        return self.classifier(self.pool(tokens, text_mask))
