"""The map-program reader: run a question's words, right to left, as operations on a soft set of patches.

:class:`MapProgramReader` is the program runner and :class:`MapProgramFuser` the fuser that puts it
between the model's encoders and its existence head (``fuser: {type: map_program}``, with
``head: {type: existence}``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vlfuse.fusers.base import FUSERS, Fused, Fuser, FuserConfig
from vlfuse.parts import EVIDENCE

OPERATIONS = ("keep", "intersect", "move")


def relative_offsets(rows: int, cols: int) -> torch.Tensor:
    """``(N, N)`` index of the offset from each target patch to each source patch, ``N = rows * cols``.

    Offsets are numbered row-major over ``(2 rows - 1) x (2 cols - 1)`` steps; offset
    ``(dr, dc)`` (source minus target, in patches) has index ``(dr + rows - 1) * (2 cols - 1) + dc + cols - 1``.
    """
    r = torch.arange(rows * cols) // cols
    c = torch.arange(rows * cols) % cols
    d_row = r[None, :] - r[:, None]  # (N target, N source)
    d_col = c[None, :] - c[:, None]
    return (d_row + rows - 1) * (2 * cols - 1) + d_col + cols - 1


@dataclass
class PatchKeys:
    """The reader's view of a batch of images, computed once per image.

    Attributes:
        key: ``(Bi, N, dim)`` the find key of each patch (one head, no values: patches are only scored).
    """

    key: torch.Tensor


class MapProgramReader(nn.Module):
    """Answers an existence question by reading its tokens as a program over image patches.

    Tokens are layer-normalised first. The reader holds a map ``m`` (one value in [0, 1] per patch
    of the image grid), full at the start. Each real question token ``x_t``, from the last to the
    first, applies a soft mix (weights ``softmax(W_op x_t)``) of three operations:

    - **keep**: ``m``;
    - **intersect**: ``m * find_t``, with ``find_t[c] = sigmoid(q_t . k_c / sqrt(dim))`` the patches
      the token's query picks out (a one-head attention score, squashed per patch, not normalised
      over patches: a set, not a distribution); queries and keys are layer-normalised after their
      projections (QK-norm), so the scores start near unit scale;
    - **move**: ``m'[c] = sum_s p_t(s - c) m[s]``, with ``p_t = softmax(W_move x_t)`` a distribution
      over the relative offsets of the grid: one offset that takes all the weight moves the whole set
      by one step, and what leaves the grid is dropped.

    The output is the evidence that something remains: ``log sum_c m[c]``, the log of the set's
    soft size (about 0 or more for a non-empty set, very negative for an empty one). The map is
    kept as ``log m`` throughout (log-sigmoid, log-softmax, log-sum-exp), so a set that has
    almost emptied after many intersections neither underflows to 0 nor stops passing gradients.

    Because every token's operation is learnt for the token and reused in every question, a
    question made of known words in a new order is executed by the same parts: the inductive bias
    of neural module networks (Andreas et al., 2016), with the layout read from word order instead
    of a parser. English puts the innermost argument last ("is a circle left of a square": find
    squares, move them, intersect with circles), hence right to left.

    Args:
        dim: width of the question tokens and image tokens.
        grid_size: ``(rows, cols)`` of the image patch grid.
    """

    def __init__(self, dim: int, grid_size: tuple[int, int]) -> None:
        super().__init__()
        rows, cols = grid_size
        self.dim, self.grid_size = dim, (rows, cols)
        self.token_norm = nn.LayerNorm(dim)
        self.find_query = nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim))
        self.find_key = nn.Sequential(nn.Linear(dim, dim), nn.LayerNorm(dim))
        self.operation = nn.Linear(dim, len(OPERATIONS))
        self.move = nn.Linear(dim, (2 * rows - 1) * (2 * cols - 1))
        self.register_buffer("offset_index", relative_offsets(rows, cols), persistent=False)

    @property
    def num_patches(self) -> int:
        return self.grid_size[0] * self.grid_size[1]

    def project_context(self, patches: torch.Tensor) -> PatchKeys:
        """Keys of the patch tokens ``(Bi, N, dim)`` -> :class:`PatchKeys` ``(Bi, N, dim)``.

        Computed once per image and shared by all the questions about it.
        """
        if patches.shape[1] != self.num_patches:
            raise ValueError(
                f"the reader was built for a {self.grid_size[0]}x{self.grid_size[1]} patch grid "
                f"({self.num_patches} patches), got {patches.shape[1]} image tokens"
            )
        return PatchKeys(self.find_key(patches))

    def _log_operations(self, normed_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Log-weights of keep/intersect/move ``(..., 3)`` and log-probabilities of the offsets."""
        return self.operation(normed_tokens).log_softmax(-1), self.move(normed_tokens).log_softmax(-1)

    def operations(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What each token does, whatever the image: ``(weights (..., 3), offsets (..., n_offsets))``.

        ``weights`` are the keep/intersect/move mix (:data:`OPERATIONS` order); ``offsets`` the
        move's distribution over relative offsets (see :func:`relative_offsets` for the order).
        """
        weights, offsets = self._log_operations(self.token_norm(tokens))
        return weights.exp(), offsets.exp()

    def offset_steps(self) -> list[tuple[int, int]]:
        """``(rows, cols)`` moved by each offset index: a token with offset ``(dr, dc)`` reads each
        patch's new value from the patch ``(dr, dc)`` away, so the set moves by ``(-dr, -dc)``."""
        rows, cols = self.grid_size
        return [(-dr, -dc) for dr in range(-(rows - 1), rows) for dc in range(-(cols - 1), cols)]

    def forward(
        self,
        tokens: torch.Tensor,
        token_mask: torch.Tensor,
        context: PatchKeys,
        image_index: torch.Tensor | None = None,
        *,
        return_maps: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Evidence ``(B,)``: the log of the soft size of the question's final set.

        Args:
            tokens: ``(B, Lt, dim)`` question tokens.
            token_mask: ``(B, Lt)`` bool, True for real tokens; padding leaves the map unchanged.
            context: patch keys from :meth:`project_context`.
            image_index: ``(B,)`` the image of each question (default: question i, image i).
            return_maps: also return the map after each token, ``(B, Lt, N)`` (the map once token
                t has been applied; padding positions repeat the map before them).
        """
        keys = context.key  # (Bi, N, dim)
        if image_index is not None:
            keys = keys[image_index]
        if keys.shape[0] != tokens.shape[0]:
            raise ValueError(f"{tokens.shape[0]} questions but {keys.shape[0]} images; pass image_index")
        tokens = self.token_norm(tokens)  # pre-norm: finds and operations see unit-scale tokens
        scores = torch.einsum("btd,bnd->btn", self.find_query(tokens), keys) / math.sqrt(self.dim)  # (B, Lt, N)
        log_find = F.logsigmoid(scores)
        log_weights, log_offsets = self._log_operations(tokens)
        log_map = tokens.new_zeros(tokens.shape[0], self.num_patches)  # log 1: every patch
        maps = []
        for t in reversed(range(tokens.shape[1])):  # one step per token: the program is sequential
            transfer = log_offsets[:, t][:, self.offset_index]  # (B, N target, N source)
            log_moved = torch.logsumexp(transfer + log_map[:, None, :], dim=-1)  # (B, N)
            options = torch.stack([log_map, log_map + log_find[:, t], log_moved], dim=-1)  # (B, N, 3)
            mixed = torch.logsumexp(options + log_weights[:, t, None, :], dim=-1)
            log_map = torch.where(token_mask[:, t, None], mixed, log_map)
            if return_maps:
                maps.append(log_map)
        evidence = torch.logsumexp(log_map, dim=-1)
        if return_maps:
            return evidence, torch.stack(maps[::-1], dim=1).exp()
        return evidence


@FUSERS.register
@dataclass
class MapProgramConfig(FuserConfig):
    """The map-program reader (``type: map_program``): no options besides the model's width and the patch grid.

    It reads the question's word embeddings (a from-scratch text encoder must have depth 0) and
    gives the evidence that the question's set is not empty, for a two-answer existence head.
    """

    type: str = "map_program"
    reads_words = True
    gives = EVIDENCE

    def build(self, dim: int, *, text_width: int, grid_size: tuple[int, int]) -> "MapProgramFuser":
        return MapProgramFuser(dim, text_width=text_width, grid_size=grid_size)


class MapProgramFuser(Fuser):
    """Two-answer existence questions (SHAPES): the question's words run as a program over the patches.

    It reads the question's word embeddings (layer-normalised, then projected by the model's
    ``text_proj``: no position, no context) with a :class:`MapProgramReader` over the image's patch
    tokens (prefix tokens such as CLS left out), and gives the reader's evidence. It has no
    cross-attention heads.

    Args:
        dim: the width of the question and image tokens.
        text_width: the width of the word embeddings.
        grid_size: ``(rows, cols)`` of the patch grid.
    """

    def __init__(self, dim: int, *, text_width: int, grid_size: tuple[int, int]) -> None:
        super().__init__()
        # word embeddings start tiny (std 0.02), under text_proj's bias: normalise them first,
        # or every word reaches the reader as nearly the same vector
        self.word_norm = nn.LayerNorm(text_width)
        self.reader = MapProgramReader(dim, grid_size)

    def question_features(self, text_encoder, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The word embeddings ``(Bq, Lt, text width)``, layer-normalised."""
        return self.word_norm(text_encoder.embed_words(input_ids))

    def image_context(self, image_tokens: torch.Tensor, num_prefix_tokens: int) -> PatchKeys:
        return self.reader.project_context(image_tokens[:, num_prefix_tokens:])

    def forward(
        self,
        text: torch.Tensor,
        text_mask: torch.Tensor,
        image_context: PatchKeys,
        image_index: torch.Tensor | None = None,
        *,
        head_masks: Sequence[torch.Tensor | None] | None = None,
        weights_from: Iterable[int] = (),
    ) -> Fused:
        return Fused(self.reader(text, text_mask, image_context, image_index), {})  # evidence (Bq,)
