"""The cell-steps reader: each cell of the patch grid holds one number, a soft "in the set", and reads
the question one word at a time, last word first, through one shared 16-head fusion block."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Literal, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vlfuse.fusers.base import FUSERS, Fused, Fuser, FuserConfig
from vlfuse.parts import EVIDENCE, MAX_HEADS, check_mlp_ratio, check_range
from vlfuse.layers import CrossAttention, FusionBlock

NEIGHBOURHOOD = 3
"""A cell's neighbourhood is the ``3 x 3`` square around it, the cell itself included."""
GATE_BIAS = -1.0
"""Initial bias of the update gate (a gate of 0.27). What a question needs learnt first is a
product of two words' updates (the last word sets the set, an earlier one intersects it), whose
size at the start is the product of their gates: 0.07 at -1, 0.002 at -3, where runs sat at the
answer prior for 6-7 epochs, or for good (docs/results.md). At 0, ten steps at a gate of 0.5 would
pass 1/1000 of the gradient back to the first word read."""


@FUSERS.register
@dataclass
class CellStepsConfig(FuserConfig):
    """The cell-steps reader (``type: cell_steps``), for two-answer existence questions (SHAPES).

    It reads the question's word embeddings (a from-scratch text encoder must have depth 0) and
    gives the evidence that the question's set is not empty, for an existence head.

    Attributes:
        heads: heads of the shared fusion block's attentions (and of each word's find, unless
            ``find_heads`` says otherwise).
        find_heads: heads of each word's find, each ``fusion_dim / find_heads`` wide (default:
            ``heads``). Wider heads keep more of what tells a circle from a square of the same
            colour (docs/results.md, issue 38).
        find_diversity_weight: weight of a penalty on distinct words whose finds look for the same
            thing: over the pairs of distinct words in the batch, the mean of ``relu(c)^2``, ``c``
            the cosine of the two words' find queries averaged over the heads (0: none). On stalled
            seeds a circle and a square took the same query in every head.
        mlp_ratio: hidden width of the block's MLP as a multiple of the fusion width.
        mlp: the block's MLP: ``swiglu`` (products: "this cell is red" x "the question asks for
            red") or ``gelu``.
        output_gate: the block's attentions gate each head's output by the query.
        dropout: dropout on the block's residual branches.
    """

    type: str = "cell_steps"
    heads: int = 16
    find_heads: int | None = None
    find_diversity_weight: float = 0.0
    mlp_ratio: float = 2.0
    mlp: Literal["gelu", "swiglu"] = "swiglu"
    output_gate: bool = True
    dropout: float = 0.0
    reads_words = True
    gives = EVIDENCE

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("fuser.heads", self.heads, 1, MAX_HEADS)
        check_range("fuser.find_heads", self.find_heads, 1, MAX_HEADS)
        check_mlp_ratio("fuser.mlp_ratio", self.mlp_ratio)
        if not self.find_diversity_weight >= 0:
            raise ValueError(f"fuser.find_diversity_weight must be >= 0, got {self.find_diversity_weight}")

    def build(self, dim: int, *, text_width: int, grid_size: tuple[int, int]) -> "CellStepsFuser":
        return CellStepsFuser(self, dim, text_width=text_width, grid_size=grid_size)


class CellStepsFuser(Fuser):
    """A one-number state per grid cell, updated by every word with the same fusion block.

    The state is ``log m``, ``m`` in (0, 1] a soft set of cells, full at the start. For each
    real word, last first:

    - the word, as the query of a 16-head attention over the patches (QK-normed), scores each
      patch once per head (a find, 16 numbers per cell; ``find_heads`` of them if set);
    - each cell's input is a position, its 16 find scores and its own and its eight neighbours'
      ``m`` (zero beyond the grid's edge: a move), all modulated by the word (FiLM:
      ``x (1 + w) + w``); the cell sees the image only through the word's find;
    - one shared fusion block (self-attention among the cells, 16-head cross-attention to the
      patches, SwiGLU) maps it to an update gate ``g`` and a candidate ``c``, to which the find
      scores add directly too;
    - ``m <- (1 - g) m + g c``, in log space.

    It gives the set's soft size, ``log sum_c m_c``, to an existence head. Only one number per
    cell passes from a word to the next, so the state cannot carry the question it came from, as a
    wide state can; the same weights act at every step, as a module of a neural module network
    does. Word embeddings only (no position, no context).

    Its one attention layer (:attr:`attention_layers`) is the shared block's cross-attention: a
    head mask or pruning acts on it at every word step, and its weights for word t are the mean,
    over the cells, of the cells' attention while they read word t: ``(Bq, H, Lt, Li)``, 0 at padding.

    Args:
        config: its options.
        dim: the fusion width.
        text_width: the width of the word embeddings.
        grid_size: ``(rows, cols)`` of the patch grid.
    """

    supports_grad_checkpointing = True

    def __init__(self, config: CellStepsConfig, dim: int, *, text_width: int, grid_size: tuple[int, int]) -> None:
        super().__init__()
        self.grad_checkpointing = False
        d, self.heads = dim, config.heads
        self.grid_size = tuple(grid_size)
        self.word_norm = nn.LayerNorm(text_width)
        self.cell_position = nn.Parameter(torch.randn(1, grid_size[0] * grid_size[1], d) * 0.02)
        self.state_in = nn.Linear(NEIGHBOURHOOD * NEIGHBOURHOOD, d)  # the cell's and its eight neighbours' m
        self.step = FusionBlock(d, self.heads, mlp_ratio=config.mlp_ratio, dropout=config.dropout,
                                self_attention=True, gated=False, output_gate=config.output_gate,
                                mlp_layer=config.mlp)
        self.norm_out = nn.LayerNorm(d)
        self.state_out = nn.Linear(d, 2)  # update gate and candidate logits
        with torch.no_grad():
            self.state_out.bias[0].fill_(GATE_BIAS)
        self.find_heads = config.find_heads or config.heads
        if d % self.find_heads:
            raise ValueError(f"fuser.find_heads ({self.find_heads}) must divide the fusion width ({d})")
        self.find_diversity_weight = config.find_diversity_weight
        self.find_query = nn.Linear(d, d)
        self.find_key = nn.Linear(d, d)
        self.head_norm = nn.LayerNorm(d // self.find_heads)  # QK-norm, per head
        self.find_out = nn.Linear(self.find_heads, 2)
        self.find_in = nn.Linear(self.find_heads, d)  # the cells see the image only through the word's finds

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Checkpoint the shared block at every word step (non-reentrant ``torch.utils.checkpoint``,
        in training with gradients enabled): backward keeps each step's inputs and recomputes the rest."""
        self.grad_checkpointing = enable

    @property
    def attention_layers(self) -> list[CrossAttention]:
        return [self.step.cross_attn]

    def attended_prefix_tokens(self, num_prefix_tokens: int) -> int:
        """None: the cells attend the patch tokens only (:meth:`image_context`)."""
        return 0

    def question_features(self, text_encoder, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The word embeddings ``(Bq, Lt, text width)``, layer-normalised."""
        return self.word_norm(text_encoder.embed_words(input_ids))

    def image_context(self, image_tokens: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
        """The patch tokens ``(Bi, cells, dim)``, without prefix tokens."""
        return image_tokens[:, num_prefix_tokens:]

    def _neighbourhood(self, values: torch.Tensor, beyond_edge: float = 0.0) -> torch.Tensor:
        """``(B, cells)`` -> each cell's 3x3 neighbourhood of ``values`` ``(B, cells, 9)``, row-major,
        ``beyond_edge`` off the grid."""
        grid = values.reshape(values.shape[0], 1, *self.grid_size)  # (B, 1, rows, cols)
        half = NEIGHBOURHOOD // 2
        padded = F.pad(grid, (half, half, half, half), value=beyond_edge)
        return F.unfold(padded, NEIGHBOURHOOD).transpose(1, 2)

    def _kept(self, log_m: torch.Tensor, text: torch.Tensor, t: int) -> torch.Tensor:
        """What the update gate keeps of the set ``log m`` ``(Bq, cells)`` as word ``t`` of ``text``
        ``(Bq, Lt, width)`` is read: the set as it is."""
        return log_m

    def find_keys(self, patches: torch.Tensor) -> torch.Tensor:
        """Each head's QK-normed find key of each patch: ``(B, cells, d) -> (B, cells, H, d / H)``."""
        return self.head_norm(self.find_key(patches).unflatten(-1, (self.find_heads, -1)))

    def find_queries(self, tokens: torch.Tensor) -> torch.Tensor:
        """Each head's QK-normed find query of each word: ``(..., d) -> (..., H, d / H)``."""
        return self.head_norm(self.find_query(tokens).unflatten(-1, (self.find_heads, -1)))

    def find_query_overlap(self, text: torch.Tensor, text_mask: torch.Tensor) -> torch.Tensor:
        """How far distinct words' find queries point the same way: the mean, over the pairs of
        distinct words among the real tokens of ``text`` ``(Bq, Lt, d)``, of ``relu(c)^2``, ``c`` the
        cosine of the two words' queries averaged over the heads; 0 with fewer than two words.

        The reader's words have no position or context, so a word's features are the same wherever
        it comes; tokens whose features have a cosine above ``1 - 1e-4`` count as one word.
        """
        tokens = text[text_mask]  # (n, d)
        unit = F.normalize(tokens.detach(), dim=-1)
        same = unit @ unit.T > 1 - 1e-4  # (n, n)
        words = tokens[~torch.tril(same, diagonal=-1).any(dim=1)]  # each word's first token
        if len(words) < 2:
            return text.new_zeros(())
        queries = F.normalize(self.find_queries(words), dim=-1)  # (words, H, dh)
        cosines = torch.einsum("ihe,jhe->ij", queries, queries) / queries.shape[1]  # (words, words)
        distinct = ~torch.eye(len(queries), dtype=torch.bool, device=text.device)
        return F.relu(cosines[distinct]).square().mean()

    def finds(self, tokens: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        """Each word's per-head scores of each patch: ``(Bq, Lt, d), (Bq, cells, d) -> (Bq, Lt, cells, H)``."""
        q = self.find_queries(tokens)  # (Bq, Lt, H, dh)
        return torch.einsum("bthe,bche->btch", q, self.find_keys(patches)) / q.shape[-1] ** 0.5

    def _read(
        self, text: torch.Tensor, text_mask: torch.Tensor, patches: torch.Tensor, scores: torch.Tensor,
        head_mask: torch.Tensor | None, draw: bool,
    ) -> Iterator[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """Reads the words last first, each through its find ``scores`` ``(Bq, Lt, cells, H)`` (:meth:`finds`):
        yields ``(t, log m (Bq, cells) once word t is read, the block's cross-attention weights
        (Bq, H, cells, Li) when ``draw``, else None)``."""
        finds = self.find_out(scores)  # (Bq, Lt, cells, 2)
        log_m = patches.new_zeros(patches.shape[:2])  # (Bq, cells): log 1, every cell
        checkpointing = self.grad_checkpointing and self.training and torch.is_grad_enabled()
        for t in range(text.shape[1] - 1, -1, -1):
            word = text[:, t, None, :]  # (Bq, 1, d)
            base = self.cell_position + self.find_in(scores[:, t])
            x = (base + self.state_in(self._neighbourhood(log_m.exp()))) * (1 + word) + word
            kept = self._kept(log_m, text, t)
            if checkpointing:
                stepped_cells = checkpoint(self.step, x, patches, need_weights=draw, head_mask=head_mask, use_reentrant=False)
            else:
                stepped_cells = self.step(x, patches, need_weights=draw, head_mask=head_mask)
            weights = None
            if draw:
                stepped_cells, weights = stepped_cells
            gate, candidate = (self.state_out(self.norm_out(stepped_cells)) + finds[:, t]).unbind(-1)
            stepped = torch.logaddexp(F.logsigmoid(-gate) + kept, F.logsigmoid(gate) + F.logsigmoid(candidate))
            log_m = torch.where(text_mask[:, t, None], stepped, log_m)  # padding leaves it
            yield t, log_m, weights

    def states(self, text: torch.Tensor, text_mask: torch.Tensor, image_context: torch.Tensor,
               image_index: torch.Tensor | None = None) -> torch.Tensor:
        """The soft set ``m`` once each word is read ``(Bq, Lt, cells)``: row t holds it after word t
        (the words are read last first, so row 0 is the final set; padding repeats the set before it).
        The arguments are :meth:`forward`'s."""
        patches = image_context if image_index is None else image_context[image_index]  # (Bq, cells, d)
        reading = self._read(text, text_mask, patches, self.finds(text, patches), None, False)
        after = {t: log_m.exp() for t, log_m, _ in reading}
        return torch.stack([after[t] for t in range(text.shape[1])], dim=1)

    def read_finds(self, text: torch.Tensor, text_mask: torch.Tensor, patches: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        """The evidence ``(Bq,)`` read with the given find ``scores`` ``(Bq, Lt, cells, H)`` in place of
        :meth:`finds` ``(text, patches)`` (``patches`` ``(Bq, cells, d)``, one image per question): the
        answer as a function of what each word found, for gradients with respect to the finds."""
        *_, (_, log_m, _) = self._read(text, text_mask, patches, scores, None, False)
        return torch.logsumexp(log_m, dim=1)

    def forward(
        self,
        text: torch.Tensor,
        text_mask: torch.Tensor,
        image_context: torch.Tensor,
        image_index: torch.Tensor | None = None,
        *,
        head_masks: Sequence[torch.Tensor | None] | None = None,
        weights_from: Iterable[int] = (),
    ) -> Fused:
        head_mask = None if head_masks is None else head_masks[0]
        draw = 0 in set(weights_from)
        patches = image_context if image_index is None else image_context[image_index]  # (Bq, cells, d)
        drawn = []
        for t, log_m, weights in self._read(text, text_mask, patches, self.finds(text, patches), head_mask, draw):
            if draw:
                drawn.append(weights.mean(2) * text_mask[:, t, None, None])  # (Bq, H, Li), 0 at padding
        attentions = {0: torch.stack(drawn[::-1], dim=2)} if draw else {}  # (Bq, H, Lt, Li)
        penalty = None
        if self.training and self.find_diversity_weight > 0 and torch.is_grad_enabled():
            penalty = self.find_diversity_weight * self.find_query_overlap(text, text_mask)
        return Fused(torch.logsumexp(log_m, dim=1), attentions, auxiliary_loss=penalty)  # evidence (Bq,)
