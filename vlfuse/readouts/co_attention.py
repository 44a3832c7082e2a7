"""The co-attention readout: the image's patch tokens read the fused question and each other, then
are max-pooled into the answer."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from vlfuse.layers import FusionStack
from vlfuse.readouts.base import Readout, register_readout


@register_readout
class CoAttentionReadout(Readout):
    """Answers from the image side: the patches are the queries of a second stack of fusion blocks.

    The model's fusion blocks let each question token read the image. This readout then runs
    ``fusion_depth`` more fusion blocks the other way round, as the co-attention layers of
    ViLBERT and LXMERT do. Before each block, a 3x3 convolution over the patch grid adds to each
    patch what its eight neighbours hold, each direction through its own weights (a positional
    encoding generator, as in CPVT, Chu et al. 2021: the direction "above" is then a fixed part of
    a token, not something to find by attention). In each block a patch attends to the other
    patches (self-attention), then to the fused question tokens (16-head cross-attention), then
    goes through the MLP. The normalised patches are max-pooled (a feature is on when it is on in
    some cell: existence), and ``Linear(Dropout(LayerNorm(.)))`` scores the answers.

    Why: a relation ("is a red shape above a circle?") is a fact about a set of cells and their
    neighbours. Pooled into a question vector, the set is lost once there are two circles; kept
    on the patches, each cell can read from the question what to look for, and from the cell
    below it whether that holds there. What it measured on SHAPES (docs/results.md#shapes): it
    fits the 212 training questions (100% training accuracy), which the pooled readout does not,
    but answers the 16 new validation questions no better than it.

    Selected by ``readout: co_attention``. Its blocks take the fusion options (heads, MLP, dropout,
    gates), so the model's fusion options all apply; prefix tokens (ViT's class token) are dropped.
    """

    name = "co_attention"
    options = ("dropout",)

    def __init__(self, config, answers: Sequence[str], *, text_width: int, grid_size: tuple[int, int]) -> None:
        super().__init__(config, answers, text_width=text_width, grid_size=grid_size)
        d = config.fusion_dim
        self.grid_size = tuple(grid_size)
        self.grid_cells = grid_size[0] * grid_size[1]
        self.neighbours = nn.ModuleList(nn.Conv2d(d, d, 3, padding=1) for _ in range(config.fusion_depth))
        self.patch_blocks = FusionStack.from_config(config, self_attention=True)  # patches read their neighbours
        self.norm_question = nn.LayerNorm(d)  # the fused tokens are a pre-LN residual stream
        self.norm_patches = nn.LayerNorm(d)
        self.classifier = nn.Sequential(nn.LayerNorm(d), nn.Dropout(config.dropout), nn.Linear(d, len(answers)))

    def image_context(self, image_tokens: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
        """The grid's patch tokens ``(Bi, rows * cols, fusion_dim)``, without prefix tokens."""
        patches = image_tokens[:, num_prefix_tokens:]
        if patches.shape[1] != self.grid_cells:
            raise ValueError(f"expected {self.grid_cells} patch tokens after the prefix, got {patches.shape[1]}")
        return patches

    def _grid_conv(self, conv: nn.Conv2d, patches: torch.Tensor) -> torch.Tensor:
        """``conv`` over the patch grid: ``(B, cells, d)`` -> ``(B, cells, d)``."""
        b, cells, d = patches.shape
        grid = patches.transpose(1, 2).reshape(b, d, *self.grid_size)  # (B, d, rows, cols)
        return conv(grid).flatten(2).transpose(1, 2)

    def forward(
        self,
        tokens: torch.Tensor,
        text_mask: torch.Tensor,
        image_context: torch.Tensor,
        image_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        patches = image_context if image_index is None else image_context[image_index]  # (Bq, cells, d)
        question = self.norm_question(tokens)
        for mix, block in zip(self.neighbours, self.patch_blocks.blocks):
            patches = patches + self._grid_conv(mix, patches)
            patches = block(patches, question, context_mask=text_mask)
        pooled = self.norm_patches(patches).amax(dim=1)  # (Bq, d): a feature is on if on in some cell
        return self.classifier(pooled)
