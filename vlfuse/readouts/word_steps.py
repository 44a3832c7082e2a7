"""The word-steps readout (a SHAPES experiment of issue 16, part 5): the patch grid reads the
question one word at a time, last word first, through one shared 16-head fusion block."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from vlfuse.layers.fusion import FusionBlock
from vlfuse.readouts.base import Readout, register_readout


@register_readout
class WordStepsReadout(Readout):
    """A state per grid cell, updated by every word of the question with the same fusion block.

    The state starts from each cell's patch token. For each real word, last first, the word
    embedding is added to every cell's state; the block's self-attention lets a cell read the
    other cells (a shift: "above"), its 16-head cross-attention reads the image patches, its MLP
    multiplies features ("this cell is red" x "the word is red"); the block's increment is kept.
    The same weights apply at every step, so a word does the same thing wherever it stands, as a
    module of a neural module network does. The cells' normalised states are max-pooled and
    ``Linear`` scores the answers. Word embeddings only (no position, no context), as the
    map-program reader reads them.
    """

    name = "word_steps"
    reads_fusion = False
    options = ("fusion_heads", "mlp_ratio", "mlp_type", "output_gate", "dropout")

    def __init__(self, config, answers: Sequence[str], *, text_width: int, grid_size: tuple[int, int]) -> None:
        super().__init__(config, answers, text_width=text_width, grid_size=grid_size)
        d = config.fusion_dim
        self.word_norm = nn.LayerNorm(text_width)
        self.start = nn.Parameter(torch.zeros(1, 1, d))
        self.cell_position = nn.Parameter(torch.randn(1, grid_size[0] * grid_size[1], d) * 0.02)
        self.step = FusionBlock(d, config.fusion_heads, mlp_ratio=config.mlp_ratio, dropout=config.dropout,
                                self_attention=True, gated=False, output_gate=config.output_gate,
                                mlp_type=config.mlp_type)
        self.norm_out = nn.LayerNorm(d)
        self.classifier = nn.Linear(d, len(answers))

    def question_features(self, text_encoder, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The word embeddings ``(Bq, Lt, text width)``, layer-normalised."""
        return self.word_norm(text_encoder.embed_words(input_ids))

    def image_context(self, image_tokens: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
        """The patch tokens ``(Bi, cells, fusion_dim)``, without prefix tokens."""
        return image_tokens[:, num_prefix_tokens:]

    def forward(self, tokens, text_mask, image_context, image_index=None) -> torch.Tensor:
        patches = image_context if image_index is None else image_context[image_index]  # (Bq, cells, d)
        state = patches + self.start + self.cell_position  # (Bq, cells, d)
        for t in range(tokens.shape[1] - 1, -1, -1):
            x = state + tokens[:, t, None, :]  # the word, on every cell
            stepped = state + (self.step(x, patches) - x)
            state = torch.where(text_mask[:, t, None, None], stepped, state)  # padding leaves it
        return self.classifier(self.norm_out(state).amax(dim=1))  # (Bq, answers)
