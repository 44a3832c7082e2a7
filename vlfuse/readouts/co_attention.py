"""The co-attention readout: the image's patch tokens read the fused question and each other, then a
learned query reads the patches."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from vlfuse.layers import CrossAttention, FusionStack
from vlfuse.readouts.base import Readout, register_readout


@register_readout
class CoAttentionReadout(Readout):
    """Answers from the image side: the patches are the queries of a second stack of fusion blocks.

    The model's fusion blocks let each question token read the image. This readout then runs
    ``fusion_depth`` more fusion blocks the other way round, as the co-attention layers of
    ViLBERT and LXMERT do: each patch token (plus a learnt embedding of its grid position) first
    attends to the other patches (self-attention), then to the fused question tokens
    (16-head cross-attention), then goes through the MLP. A learnt query finally attends to the
    patches (16 heads), and ``Linear(Dropout(LayerNorm(.)))`` scores the answers.

    Why: a relation ("is a red shape above a circle?") is a fact about a set of cells and their
    neighbours. Pooled into a question vector, the set is lost once there are two circles; kept
    on the patches, each cell can read from the question what to look for, and from the cell
    below it whether that holds there.

    Selected by ``readout: co_attention``. Its blocks take the fusion options (heads, MLP, dropout,
    gates), so the model's fusion options all apply; prefix tokens (ViT's class token) are dropped.
    """

    name = "co_attention"
    options = ("dropout",)

    def __init__(self, config, answers: Sequence[str], *, text_width: int, grid_size: tuple[int, int]) -> None:
        super().__init__(config, answers, text_width=text_width, grid_size=grid_size)
        d = config.fusion_dim
        rows, cols = grid_size
        self.grid_cells = rows * cols
        self.position = nn.Parameter(torch.zeros(1, self.grid_cells, d))  # one per grid cell
        nn.init.trunc_normal_(self.position, std=0.02)
        self.patch_blocks = FusionStack(
            config.fusion_depth,
            d,
            config.fusion_heads,
            mlp_ratio=config.mlp_ratio,
            dropout=config.dropout,
            attn_dropout=config.attn_dropout,
            self_attention=True,  # patches read their neighbours
            gated=config.gated,
            attention_normalizer=config.attention_normalizer,
            output_gate=config.output_gate,
            mlp_type=config.mlp_type,
        )
        self.query = nn.Parameter(torch.zeros(1, 1, d))
        nn.init.trunc_normal_(self.query, std=0.02)
        self.pool = CrossAttention(d, config.fusion_heads)
        self.classifier = nn.Sequential(nn.LayerNorm(d), nn.Dropout(config.dropout), nn.Linear(d, len(answers)))

    def image_context(self, image_tokens: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
        """The grid's patch tokens ``(Bi, rows * cols, fusion_dim)``, without prefix tokens."""
        patches = image_tokens[:, num_prefix_tokens:]
        if patches.shape[1] != self.grid_cells:
            raise ValueError(f"expected {self.grid_cells} patch tokens after the prefix, got {patches.shape[1]}")
        return patches

    def forward(
        self,
        tokens: torch.Tensor,
        text_mask: torch.Tensor,
        image_context: torch.Tensor,
        image_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        patches = image_context if image_index is None else image_context[image_index]  # (Bq, cells, d)
        patches, _ = self.patch_blocks(patches + self.position, tokens, context_mask=text_mask)
        query = self.query.expand(len(patches), -1, -1)  # (Bq, 1, d)
        pooled = self.pool(query, patches).squeeze(1)  # (Bq, d)
        return self.classifier(pooled)
