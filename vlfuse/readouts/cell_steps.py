"""The cell-steps readout (a SHAPES experiment of issue 16, part 5): each cell of the patch grid
holds one number, a soft "in the set", and reads the question one word at a time, last word first,
through one shared 16-head fusion block."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vlfuse.layers.fusion import FusionBlock
from vlfuse.readouts.base import Readout, register_readout
from vlfuse.readouts.map_program import ExistenceClassifier, check_word_existence_reader

GATE_BIAS = -1.0
"""Initial bias of the update gate (a gate of 0.27). What a question needs learnt first is a
product of two words' updates (the last word sets the set, an earlier one intersects it), whose
size at the start is the product of their gates: 0.07 at -1, 0.002 at -3, where runs sat at the
answer prior for 6-7 epochs, or for good (docs/results.md). At 0, ten steps at a gate of 0.5 would
pass 1/1000 of the gradient back to the first word read."""


@register_readout
class CellStepsReadout(Readout):
    """A one-number state per grid cell, updated by every word with the same fusion block.

    The state is ``log m``, ``m`` in (0, 1] a soft set of cells, full at the start. For each
    real word, last first:

    - the word, as the query of a 16-head attention over the patches (QK-normed), scores each
      patch once per head (a find, 16 numbers per cell);
    - each cell's input is a position, its 16 find scores and its own and its eight neighbours'
      ``m`` (zero beyond the grid's edge: a move), all modulated by the word (FiLM:
      ``x (1 + w) + w``); the cell sees the image only through the word's find;
    - one shared fusion block (self-attention among the cells, 16-head cross-attention to the
      patches, SwiGLU) maps it to an update gate ``g`` and a candidate ``c``, to which the find
      scores add directly too;
    - ``m <- (1 - g) m + g c``, in log space.

    The answer comes from the set's soft size, ``log sum_c m_c``, with a fixed-scale existence
    head. Only one number per cell passes from a word to the next, so the state cannot carry the
    question it came from, as a wide state can; the same weights act at every step, as a
    module of a neural module network does. Word embeddings only (no position, no context).
    """

    name = "cell_steps"
    reads_fusion = False
    options = ("fusion_heads", "mlp_ratio", "mlp_type", "output_gate", "dropout")

    def __init__(self, config, answers: Sequence[str], *, text_width: int, grid_size: tuple[int, int]) -> None:
        super().__init__(config, answers, text_width=text_width, grid_size=grid_size)
        d, self.heads = config.fusion_dim, config.fusion_heads
        self.grid_size = tuple(grid_size)
        self.word_norm = nn.LayerNorm(text_width)
        self.cell_position = nn.Parameter(torch.randn(1, grid_size[0] * grid_size[1], d) * 0.02)
        self.state_in = nn.Linear(9, d)  # the cell's and its eight neighbours' m
        self.step = FusionBlock(d, self.heads, mlp_ratio=config.mlp_ratio, dropout=config.dropout,
                                self_attention=True, gated=False, output_gate=config.output_gate,
                                mlp_type=config.mlp_type)
        self.norm_out = nn.LayerNorm(d)
        self.state_out = nn.Linear(d, 2)  # update gate and candidate logits
        with torch.no_grad():
            self.state_out.bias[0].fill_(GATE_BIAS)
        self.existence = ExistenceClassifier()
        self.find_query = nn.Linear(d, d)
        self.find_key = nn.Linear(d, d)
        self.head_norm = nn.LayerNorm(d // self.heads)  # QK-norm, per head
        self.find_out = nn.Linear(self.heads, 2)
        self.find_in = nn.Linear(self.heads, d)  # the cells see the image only through the word's finds

    @classmethod
    def check(cls, config, answers: Sequence[str]) -> None:
        check_word_existence_reader(cls.name, config, answers)

    def question_features(self, text_encoder, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The word embeddings ``(Bq, Lt, text width)``, layer-normalised."""
        return self.word_norm(text_encoder.embed_words(input_ids))

    def image_context(self, image_tokens: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
        """The patch tokens ``(Bi, cells, fusion_dim)``, without prefix tokens."""
        return image_tokens[:, num_prefix_tokens:]

    def _neighbourhood(self, m: torch.Tensor) -> torch.Tensor:
        """``(B, cells)`` -> each cell's 3x3 neighbourhood of ``m`` ``(B, cells, 9)``, zero off the grid."""
        grid = m.reshape(m.shape[0], 1, *self.grid_size)  # (B, 1, rows, cols)
        return F.unfold(grid, 3, padding=1).transpose(1, 2)

    def _finds(self, tokens: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        """Each word's per-head scores of each patch: ``(Bq, Lt, d), (Bq, cells, d) -> (Bq, Lt, cells, H)``."""
        q = self.head_norm(self.find_query(tokens).unflatten(-1, (self.heads, -1)))  # (Bq, Lt, H, dh)
        k = self.head_norm(self.find_key(patches).unflatten(-1, (self.heads, -1)))  # (Bq, cells, H, dh)
        return torch.einsum("bthe,bche->btch", q, k) / q.shape[-1] ** 0.5

    def forward(self, tokens, text_mask, image_context, image_index=None) -> torch.Tensor:
        patches = image_context if image_index is None else image_context[image_index]  # (Bq, cells, d)
        scores = self._finds(tokens, patches)  # (Bq, Lt, cells, H)
        finds = self.find_out(scores)  # (Bq, Lt, cells, 2)
        log_m = patches.new_zeros(patches.shape[:2])  # (Bq, cells): log 1, every cell
        for t in range(tokens.shape[1] - 1, -1, -1):
            word = tokens[:, t, None, :]  # (Bq, 1, d)
            base = self.cell_position + self.find_in(scores[:, t])
            x = (base + self.state_in(self._neighbourhood(log_m.exp()))) * (1 + word) + word
            gate, candidate = (self.state_out(self.norm_out(self.step(x, patches))) + finds[:, t]).unbind(-1)
            stepped = torch.logaddexp(F.logsigmoid(-gate) + log_m, F.logsigmoid(gate) + F.logsigmoid(candidate))
            log_m = torch.where(text_mask[:, t, None], stepped, log_m)  # padding leaves it
        return self.existence(torch.logsumexp(log_m, dim=1))  # (Bq, 2)
