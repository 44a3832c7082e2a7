"""Packed tokens: the real tokens of padded rows, one after another, grouped by the context they read.

Questions of different lengths arrive padded, ``(B, L, dim)`` with a ``(B, L)`` mask, and with many
questions per image. The per-token work of a fusion block (norms, projections, gates, MLP,
dropout) runs on the real tokens alone, packed to ``(N, dim)`` (:class:`TokenPacking`); attention
runs per image over the real tokens of all its questions, in rows of at most :data:`QUERY_CHUNK`
tokens, ``(R, Lg, ...)`` (:class:`ContextGroups`), instead of over every question's padded rows
side by side.
"""

from __future__ import annotations

import torch


class TokenPacking:
    """Where the real tokens of padded rows go when packed one after another, and back.

    Args:
        batch: ``B``, the number of rows.
        length: ``L``, the padded length of a row.
        mask: ``(B, L)`` bool, True for real tokens; ``None``: every token is real (packing is
            then a reshape, no copy).
        device: where the index tensors live when there is no ``mask``.

    Attributes:
        mask: the ``mask`` given.
        rows: ``(N,)`` the row of each packed token, in packed order (row by row, left to right).
    """

    def __init__(self, batch: int, length: int, mask: torch.Tensor | None = None, device=None) -> None:
        if mask is not None and mask.shape != (batch, length):
            raise ValueError(f"text mask must have shape (batch, length) = {(batch, length)}, got {tuple(mask.shape)}")
        self.batch, self.length, self.mask = batch, length, mask
        self.index = None if mask is None or bool(mask.all()) else mask.flatten().nonzero().squeeze(1)  # (N,)
        if self.index is None:
            device = mask.device if mask is not None else device
            self.rows = torch.arange(batch, device=device).repeat_interleave(length)
        else:
            self.rows = self.index.div(length, rounding_mode="floor")

    def __len__(self) -> int:
        return len(self.rows)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """``(B, L, *rest) -> (N, *rest)``: the real tokens."""
        flat = x.reshape(self.batch * self.length, *x.shape[2:])
        return flat if self.index is None else flat.index_select(0, self.index)

    def unpack(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """``(N, *rest) -> (B, L, *rest)``: the real tokens back in their rows, ``padding`` ``(B, L, *rest)``
        where there is none."""
        if self.index is None:
            return tokens.view(self.batch, self.length, *tokens.shape[1:])
        flat = padding.reshape(self.batch * self.length, *padding.shape[2:])
        return flat.index_copy(0, self.index, tokens).view_as(padding)


def per_token_head_mask(head_mask: torch.Tensor | None, packing: TokenPacking) -> torch.Tensor | None:
    """A per-row head mask ``(B, H)`` as ``(N, H)``, one row per packed token; ``(H,)`` or ``None`` as given."""
    return head_mask[packing.rows] if head_mask is not None and head_mask.dim() == 2 else head_mask


QUERY_CHUNK = 32
"""Longest row of query tokens that attention reads one context with (see :class:`ContextGroups`)."""


class ContextGroups:
    """Packed tokens laid out in rows by the context (image) they attend to: ``(N, C) -> (R, Lg, C)``.

    Each context's tokens, in packed order, fill rows of at most ``chunk`` tokens, the last row of
    a context followed by zeros up to ``Lg`` (the longest row); :meth:`ungroup` drops the zeros
    again. Attention then runs once per row against its context (:attr:`row_context`). Cross-
    attention queries do not see each other, so splitting a context's tokens over several rows
    changes nothing but the padding: with many questions on some images and few on others (easy-VQA:
    65 tokens per image on average, 176 on the busiest), rows of one whole context each would be
    padded to the busiest context's count.

    Args:
        context: ``(N,)`` the context row of each token.
        num_contexts: ``Bc``, the number of context rows.
        chunk: the most tokens in a row (:data:`QUERY_CHUNK`); ``None``: one row per context.
            Contexts of equal size in packed order (e.g. one unpadded question per image) always
            get one row each: that layout is a reshape.

    Attributes:
        context: ``(N,)`` as given.
        size: ``Lg``, the longest row.
        num_rows: ``R``.
        row_context: ``(R,)`` the context of each row, or ``None`` when row ``c`` is context ``c``.
    """

    def __init__(self, context: torch.Tensor, num_contexts: int, chunk: int | None = QUERY_CHUNK) -> None:
        counts = torch.bincount(context, minlength=num_contexts)  # (Bc,)
        self.context, self.num_contexts = context, num_contexts
        longest = int(counts.max()) if len(context) else 0
        # Contexts of equal size in packed order: a reshape, one row each.
        self.in_place = len(context) == num_contexts * longest and bool((context[1:] >= context[:-1]).all())
        if chunk is None or self.in_place or longest <= chunk:
            chunk = max(longest, 1)
        order = torch.argsort(context, stable=True)
        first = torch.cumsum(counts, 0) - counts  # (Bc,) where each context starts in ``order``
        slot = torch.empty_like(context)
        slot[order] = torch.arange(len(context), device=context.device) - first[context[order]]  # rank in its context
        rows_of_context = (counts + chunk - 1).div(chunk, rounding_mode="floor").clamp_min(1)  # (Bc,) empty: one row
        first_row = torch.cumsum(rows_of_context, 0) - rows_of_context  # (Bc,)
        self.size = min(chunk, longest)
        self.num_rows = int(rows_of_context.sum())
        self.row_context = (
            None if self.num_rows == num_contexts
            else torch.arange(num_contexts, device=context.device).repeat_interleave(rows_of_context)
        )
        row = first_row[context] + slot.div(chunk, rounding_mode="floor")  # (N,)
        self.destination = row * self.size + slot % chunk  # (N,) place of each token in (R * Lg)

    def rows(self, per_context: torch.Tensor) -> torch.Tensor:
        """Something per context ``(Bc, ...)`` -> per row ``(R, ...)`` (keys, values, masks)."""
        return per_context if self.row_context is None else per_context.index_select(0, self.row_context)

    def group(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(N, C) -> (R, Lg, C)``, zeros in the unused slots."""
        if self.in_place:
            return tokens.view(self.num_rows, self.size, -1)
        grouped = tokens.new_zeros(self.num_rows * self.size, tokens.shape[1])
        return grouped.index_copy(0, self.destination, tokens).view(self.num_rows, self.size, -1)

    def ungroup(self, grouped: torch.Tensor) -> torch.Tensor:
        """``(R, Lg, C) -> (N, C)``."""
        flat = grouped.reshape(self.num_rows * self.size, -1)
        return flat if self.in_place else flat.index_select(0, self.destination)
