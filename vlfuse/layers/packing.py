"""Packed tokens: the real tokens of padded rows, one after another, grouped by the context they read.

Questions of different lengths arrive padded, ``(B, L, dim)`` with a ``(B, L)`` mask, and with many
questions per image. The per-token work of a fusion block (norms, projections, gates, MLP,
dropout) runs on the real tokens alone, packed to ``(N, dim)`` (:class:`TokenPacking`); attention
runs once per image over the real tokens of all its questions, ``(Bc, Lg, ...)``
(:class:`ContextGroups`), instead of over every question's padded rows side by side.
:class:`PackedTokens` holds both: the one object a fusion stack hands down its blocks.

Packing's sizes (``N``, ``Lg``) depend on the mask's values, which ``torch.export`` and
``torch.compile(fullgraph=True)`` cannot trace. :class:`PaddedTokens` is the same layout object
for them: every position of every row is a token, and each row is its own group, ``(B, L, ...)``.
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
        self.index = self._real_positions(mask)
        if self.index is None:
            device = mask.device if mask is not None else device
            self.rows = torch.arange(batch, device=device).repeat_interleave(length)
        else:
            self.rows = self.index.div(length, rounding_mode="floor")

    @staticmethod
    def _real_positions(mask: torch.Tensor | None) -> torch.Tensor | None:
        """``(N,)`` the flat positions of the real tokens, or ``None`` when every position is kept."""
        return None if mask is None or bool(mask.all()) else mask.flatten().nonzero().squeeze(1)

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


class ContextGroups:
    """Packed tokens laid out by the context row (image) they attend to: ``(N, C) -> (Bc, Lg, C)``.

    Group ``c`` holds, in packed order, the tokens whose context is ``c``, followed by zeros up to
    ``Lg``, the size of the largest group; :meth:`ungroup` drops the zeros again.

    Args:
        context: ``(N,)`` the context row of each token.
        num_contexts: ``Bc``, the number of context rows.

    Attributes:
        context: ``(N,)`` as given.
        size: ``Lg``, the longest group.
    """

    def __init__(self, context: torch.Tensor, num_contexts: int) -> None:
        counts = torch.bincount(context, minlength=num_contexts)  # (Bc,)
        order = torch.argsort(context, stable=True)
        first = torch.cumsum(counts, 0) - counts  # (Bc,) where each group starts in ``order``
        slot = torch.empty_like(context)
        slot[order] = torch.arange(len(context), device=context.device) - first[context[order]]
        self.context, self.num_contexts = context, num_contexts
        self.size = int(counts.max()) if len(context) else 0
        self.destination = context * self.size + slot  # (N,) row of each token in (Bc * Lg)
        # Groups of equal size in packed order (e.g. one unpadded question per image): a reshape.
        self.in_place = len(context) == num_contexts * self.size and bool((context[1:] >= context[:-1]).all())

    def group(self, tokens: torch.Tensor) -> torch.Tensor:
        """``(N, C) -> (Bc, Lg, C)``, zeros in the unused slots."""
        width = tokens.shape[1]  # explicit: a view of no token cannot infer it
        if self.in_place:
            return tokens.view(self.num_contexts, self.size, width)
        grouped = tokens.new_zeros(self.num_contexts * self.size, width)
        return grouped.index_copy(0, self.destination, tokens).view(self.num_contexts, self.size, width)

    def ungroup(self, grouped: torch.Tensor) -> torch.Tensor:
        """``(Bc, Lg, C) -> (N, C)``."""
        flat = grouped.reshape(self.num_contexts * self.size, grouped.shape[-1])
        return flat if self.in_place else flat.index_select(0, self.destination)


class PackedTokens(TokenPacking):
    """The real tokens of padded text rows, packed, and the image (context row) each token reads.

    The one layout object a fusion stack hands down its blocks: per-token work runs on
    :meth:`pack`'s ``(N, dim)``, self-attention on :meth:`to_rows` ``(B, L, dim)``, cross-attention on
    :attr:`groups` (the tokens of each image together, ``(Bc, Lg, dim)``).

    Args:
        batch, length, mask, device: as for :class:`TokenPacking`.
        image_index: ``(B,)`` the context row of each text row (default: row i reads context row i).
        num_images: ``Bc``, the number of context rows.

    Attributes:
        groups: the packed tokens by context row (:class:`ContextGroups`).
    """

    def __init__(self, batch: int, length: int, mask: torch.Tensor | None, image_index: torch.Tensor | None,
                 num_images: int, device=None) -> None:
        super().__init__(batch, length, mask, device=device)
        if image_index is None and self.index is None:  # every token real, row b reads image b: nothing to count
            self.groups = RowGroups(self.rows, batch, length)
        else:
            image_of_token = self.rows if image_index is None else image_index[self.rows]  # (N,)
            self.groups = ContextGroups(image_of_token, num_images)

    @classmethod
    def of(cls, x: torch.Tensor, mask: torch.Tensor | None, image_index: torch.Tensor | None, num_images: int) -> "PackedTokens":
        """The layout of text ``x`` ``(B, L, dim)`` with ``mask`` ``(B, L)`` (``None``: every token is real)."""
        return cls(x.shape[0], x.shape[1], mask, image_index, num_images, device=x.device)

    def to_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Packed ``(N, C)`` -> padded rows ``(B, L, C)``, zeros at padding positions."""
        return self.unpack(tokens, tokens.new_zeros(self.batch, self.length, tokens.shape[-1]))

    def per_token(self, head_mask: torch.Tensor | None) -> torch.Tensor | None:
        """A per-row head mask ``(B, H)`` as ``(N, H)``, one row per packed token; ``(H,)`` or ``None`` as given."""
        return head_mask[self.rows] if head_mask is not None and head_mask.dim() == 2 else head_mask


class RowGroups(ContextGroups):
    """Every padded row its own group: ``(B * L, C) <-> (B, L, C)``, reshapes of sizes known from the shapes.

    The grouping of :class:`PaddedTokens`: row ``b`` reads context row ``b`` (contexts shared
    between rows are copied to their rows first). Nothing is counted, so nothing depends on the data.
    Also :class:`PackedTokens`' grouping when every token is real and row ``b`` reads image ``b``
    (e.g. each step of greedy decoding), where :class:`ContextGroups` would count its way to the same.

    Args:
        rows: ``(B * L,)`` the row of each token.
        batch: ``B``, the number of rows (and of context rows).
        length: ``L``, the padded length of a row.
    """

    def __init__(self, rows: torch.Tensor, batch: int, length: int) -> None:  # no ContextGroups.__init__: no counting
        self.context, self.num_contexts, self.size = rows, batch, length
        self.in_place = True


class PaddedTokens(PackedTokens):
    """The padded reference layout: every position of every row is a token, padding included.

    The layout of ``torch.export`` and ``torch.compile`` (:mod:`vlfuse.layers.fusion` chooses it
    there): its sizes come from the shapes alone, no ``.item()`` nor ``nonzero``. Per-token work
    runs on ``(B * L, dim)``, text self-attention on the rows under the text mask, cross-attention on
    each row over its own context row (:class:`RowGroups`), and :meth:`unpack` keeps ``padding`` at
    the padding positions: the real tokens' results are :class:`PackedTokens`' (within float
    rounding), at the cost of the padding's work.

    Args:
        batch, length, mask, device: as for :class:`TokenPacking`.
    """

    def __init__(self, batch: int, length: int, mask: torch.Tensor | None, device=None) -> None:
        TokenPacking.__init__(self, batch, length, mask, device=device)  # not PackedTokens': no grouping by image
        self.groups = RowGroups(self.rows, batch, length)

    @staticmethod
    def _real_positions(mask: torch.Tensor | None) -> None:
        """Every position is kept: packing is a reshape."""
        return None

    def unpack(self, tokens: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """``(B * L, *rest) -> (B, L, *rest)``: the tokens in their rows, ``padding`` where the mask is False."""
        rows = tokens.reshape(self.batch, self.length, *tokens.shape[1:])  # (B, L, *rest)
        if self.mask is None:
            return rows
        real = self.mask.view(self.batch, self.length, *[1] * (tokens.dim() - 1))  # (B, L, 1, ...)
        return torch.where(real, rows, padding)
