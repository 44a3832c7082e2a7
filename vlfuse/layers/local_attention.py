"""Local self-attention for long inputs: which (query, key) pairs may attend, and the layer that uses it.

A :class:`LocalLayout` holds one rule, ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` (True = may
attend, FlexAttention's convention), and builds from it both a dense ``(L, L)`` bool mask (for
``F.scaled_dot_product_attention`` or the explicit path) and a FlexAttention ``BlockMask`` whose
empty 128x128 tiles are skipped, so that sparsity saves time. Three layouts:

- :func:`sliding_window`: 1-D, token i attends to tokens j with ``|i - j| <= window``;
- :func:`grid_neighbourhood`: 2-D, patch tokens on a ``grid_h x grid_w`` grid (row-major) attend
  to the patches within ``radius`` rows and columns; prefix tokens (CLS, registers) before the grid
  attend to everything and are attended by everything;
- :func:`block_sparse`: blocks of ``block`` tokens attend to their own and ``neighbours`` blocks
  on each side, and the first ``global_blocks`` blocks attend to and are attended by every token
  (a Longformer/BigBird-style layout without random blocks).

Every layout lets each token attend to itself, so no row is ever fully masked (a padding mask on
top of a layout can leave a query with no key: :class:`LocalSelfAttention` gives it a zero output).

:class:`LocalSelfAttention` is the layer: projections and all, a self-attention over one sequence
with a layout. :func:`local_self_attention` is its core and runs attention with a layout: through compiled FlexAttention where
the installed torch supports it for the call, otherwise through SDPA with the dense mask (the same
result). On CPU, torch 2.14's FlexAttention has no backward pass and no dropout: calls that need
gradients (or dropout) use the dense mask. Each (layout, shape) pair compiles its own kernel on
first use (10-20 s on CPU, cached on disk by torch); past ``torch._dynamo.config.recompile_limit``
(8) kernels torch runs FlexAttention uncompiled, which is correct but computes every pair.
"""

from __future__ import annotations

import functools
import math
import warnings
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F

from vlfuse.layers.attention import KeyMask, Normalizer, SelfAttention, softmax_normalize

if TYPE_CHECKING:
    from torch.nn.attention.flex_attention import BlockMask

MaskMod = Callable[[torch.Tensor | None, torch.Tensor | None, torch.Tensor, torch.Tensor], torch.Tensor]
FLEX_BLOCK = 128
"""FlexAttention's tile size: a BlockMask skips 128 x 128 tiles in which no pair may attend."""
_CHUNK_ELEMENTS = 1 << 22  # mask entries evaluated at once when building masks


@functools.cache
def _flex_module() -> ModuleType | None:
    """``torch.nn.attention.flex_attention``, imported on first use (it adds most of a second to
    ``import vlfuse``), or ``None`` for a torch without it (layouts then give dense masks only)."""
    try:
        from torch.nn.attention import flex_attention
    except ImportError:
        return None
    return flex_attention


@dataclass(eq=False)
class LocalLayout:
    """Which (query, key) pairs of a self-attention over ``length`` tokens may attend.

    The dense mask and the FlexAttention block mask are built on first use, per device, and
    kept (a dense mask of 16k tokens takes 256 MiB; drop the layout to free it).

    Attributes:
        name: a short description, e.g. ``"sliding window +-64"``.
        length: the number of tokens (queries and keys).
        mask_mod: ``(b, h, q_idx, kv_idx) -> bool tensor``, True where query ``q_idx`` may attend key
            ``kv_idx``; written with tensor operations only, so that it broadcasts and FlexAttention
            can compile it (``b`` and ``h`` are ignored by the layouts of this module).
    """

    name: str
    length: int
    mask_mod: MaskMod
    _cache: dict = field(default_factory=dict, init=False, repr=False)

    def _rows(self, start: int, stop: int, device: torch.device) -> torch.Tensor:
        """The mask rows of queries ``start..stop-1``: ``(stop - start, length)`` bool."""
        # int32, as FlexAttention passes indices (and twice as fast as int64 on CPU)
        q_idx = torch.arange(start, stop, dtype=torch.int32, device=device)[:, None]
        kv_idx = torch.arange(self.length, dtype=torch.int32, device=device)[None, :]
        return self.mask_mod(None, None, q_idx, kv_idx)

    def dense(self, device: torch.device | str | None = None) -> torch.Tensor:
        """The ``(length, length)`` bool mask, True where a query (row) may attend a key (column)."""
        device = torch.device(device or "cpu")
        key = ("dense", device)
        if key not in self._cache:
            mask = torch.empty(self.length, self.length, dtype=torch.bool, device=device)
            step = max(1, _CHUNK_ELEMENTS // max(1, self.length))
            for start in range(0, self.length, step):
                stop = min(self.length, start + step)
                mask[start:stop] = self._rows(start, stop, device)
            self._cache[key] = mask
        return self._cache[key]

    def block_mask(self, device: torch.device | str | None = None) -> "BlockMask":
        """The FlexAttention ``BlockMask`` of this layout (tiles of :data:`FLEX_BLOCK` tokens).

        Built row tile by row tile from ``mask_mod`` (about 8 s at 16k tokens on 2 CPU cores, under
        half the time of an uncompiled ``create_block_mask``; the same tiles). A tile is
        *full* (``mask_mod`` skipped inside it) only when every pair in it may attend and it lies
        wholly inside the sequence; tiles with some allowed pairs are *partial*; the rest are skipped.
        """
        if _flex_module() is None:
            raise RuntimeError(f"torch {torch.__version__} has no FlexAttention (torch.nn.attention.flex_attention)")
        device = torch.device(device or "cpu")
        key = ("block", device)
        if key not in self._cache:
            self._cache[key] = self._build_block_mask(device)
        return self._cache[key]

    def _build_block_mask(self, device: torch.device) -> "BlockMask":
        tiles = math.ceil(self.length / FLEX_BLOCK)
        padded = tiles * FLEX_BLOCK
        partial = torch.zeros(tiles, tiles, dtype=torch.bool, device=device)
        full = torch.zeros(tiles, tiles, dtype=torch.bool, device=device)
        for i in range(tiles):
            start, stop = i * FLEX_BLOCK, min(self.length, (i + 1) * FLEX_BLOCK)
            rows = F.pad(self._rows(start, stop, device), (0, padded - self.length))  # keys past the end: False
            rows = rows.view(stop - start, tiles, FLEX_BLOCK)  # (queries of tile i, key tiles, FLEX_BLOCK)
            any_pair = rows.any(dim=2).any(dim=0)  # (tiles,)
            every_pair = rows.all(dim=2).all(dim=0) & (stop - start == FLEX_BLOCK)
            full[i] = every_pair
            partial[i] = any_pair & ~every_pair

        def listed(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            counts = blocks.sum(-1, dtype=torch.int32)  # (tiles,)
            # Indices of the listed tiles first, in key order; the rest of each row is ignored.
            order = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # (tiles, tiles)
            return counts[None, None], order[None, None]  # (1, 1, tiles), (1, 1, tiles, tiles)

        kv_num, kv_index = listed(partial)
        full_num, full_index = listed(full)
        return _flex_module().BlockMask.from_kv_blocks(
            kv_num, kv_index, full_num, full_index, BLOCK_SIZE=FLEX_BLOCK, mask_mod=self.mask_mod,
            seq_lengths=(self.length, self.length),
        )


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def sliding_window(length: int, window: int) -> LocalLayout:
    """1-D sliding window: token i may attend token j when ``|i - j| <= window``.

    Args:
        length: number of tokens.
        window: how many tokens each side a token sees (``2 * window + 1`` keys in the middle).
    """
    _check_positive(length=length)
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be a non-negative integer, got {window!r}")

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= window

    return LocalLayout(f"sliding window +-{window}", length, mask_mod)


def grid_neighbourhood(grid_h: int, grid_w: int, radius: int, num_prefix_tokens: int = 0) -> LocalLayout:
    """2-D neighbourhood on a patch grid: a square of ``(2 * radius + 1)^2`` patches around each patch.

    Tokens are ``num_prefix_tokens`` prefix tokens (CLS, registers) followed by the
    ``grid_h * grid_w`` patches in row-major order, as timm's vision transformers lay them out.
    Patch (r, c) may attend patch (r', c') when ``|r - r'| <= radius`` and ``|c - c'| <= radius``;
    prefix tokens are global: they attend to every token and every token attends to them.

    Args:
        grid_h, grid_w: rows and columns of the patch grid.
        radius: the neighbourhood's half-width, in patches.
        num_prefix_tokens: tokens before the grid.
    """
    _check_positive(grid_h=grid_h, grid_w=grid_w)
    if not isinstance(radius, int) or radius < 0:
        raise ValueError(f"radius must be a non-negative integer, got {radius!r}")
    if not isinstance(num_prefix_tokens, int) or num_prefix_tokens < 0:
        raise ValueError(f"num_prefix_tokens must be a non-negative integer, got {num_prefix_tokens!r}")
    prefix = num_prefix_tokens

    def mask_mod(b, h, q_idx, kv_idx):
        q_patch, kv_patch = q_idx - prefix, kv_idx - prefix  # negative for prefix tokens
        near_rows = (q_patch // grid_w - kv_patch // grid_w).abs() <= radius
        near_cols = (q_patch % grid_w - kv_patch % grid_w).abs() <= radius
        return (q_patch < 0) | (kv_patch < 0) | (near_rows & near_cols)

    name = f"grid {grid_h}x{grid_w} radius {radius}" + (f" + {prefix} global" if prefix else "")
    return LocalLayout(name, prefix + grid_h * grid_w, mask_mod)


def block_sparse(length: int, block: int, *, neighbours: int = 1, global_blocks: int = 1) -> LocalLayout:
    """Block-sparse layout: local blocks plus a few global ones.

    Tokens are cut into blocks of ``block`` (the last one may be shorter). A token of block i may
    attend the tokens of blocks j with ``|i - j| <= neighbours``; the first ``global_blocks`` blocks
    are global: their tokens attend to every token and every token attends to them. With
    ``block = 128`` the layout matches FlexAttention's tiles exactly.

    Args:
        length: number of tokens.
        block: tokens per block.
        neighbours: blocks seen on each side of a block's own.
        global_blocks: leading blocks that are global (0 for none).
    """
    _check_positive(length=length, block=block)
    for name, value in (("neighbours", neighbours), ("global_blocks", global_blocks)):
        if not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")

    def mask_mod(b, h, q_idx, kv_idx):
        q_block, kv_block = q_idx // block, kv_idx // block
        return ((q_block - kv_block).abs() <= neighbours) | (q_block < global_blocks) | (kv_block < global_blocks)

    return LocalLayout(f"block-sparse {block}, +-{neighbours} blocks, {global_blocks} global", length, mask_mod)


def sliding_window_mask(length: int, window: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The dense ``(length, length)`` bool mask of :func:`sliding_window` (True = may attend)."""
    return sliding_window(length, window).dense(device)


def grid_neighbourhood_mask(
    grid_h: int, grid_w: int, radius: int, num_prefix_tokens: int = 0, device: torch.device | str | None = None
) -> torch.Tensor:
    """The dense ``(L, L)`` bool mask of :func:`grid_neighbourhood`, ``L = prefix + grid_h * grid_w``."""
    return grid_neighbourhood(grid_h, grid_w, radius, num_prefix_tokens).dense(device)


def block_sparse_mask(
    length: int, block: int, *, neighbours: int = 1, global_blocks: int = 1, device: torch.device | str | None = None
) -> torch.Tensor:
    """The dense ``(length, length)`` bool mask of :func:`block_sparse` (True = may attend)."""
    return block_sparse(length, block, neighbours=neighbours, global_blocks=global_blocks).dense(device)


# ------------------------------------------------------------------------------ running attention
_compiled_flex: Callable | None = None
_flex_broken: str | None = None  # why compiled FlexAttention failed in this process, once it has


def flex_unsupported_reason(q: torch.Tensor, *tensors: torch.Tensor, dropout_p: float = 0.0) -> str | None:
    """Why compiled FlexAttention cannot run this call (``None`` when it can)."""
    if _flex_module() is None:
        return f"torch {torch.__version__} has no FlexAttention"
    if _flex_broken is not None:
        return f"FlexAttention failed earlier in this process ({_flex_broken})"
    if q.device.type not in ("cpu", "cuda"):
        return f"FlexAttention does not run on {q.device.type}"
    if dropout_p > 0:
        return "FlexAttention has no attention dropout"
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, *tensors))
    if q.device.type == "cpu" and needs_grad:
        return "FlexAttention has no backward pass on CPU"
    return None


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask: "BlockMask") -> torch.Tensor:
    global _compiled_flex
    if _compiled_flex is None:
        # Without torch.compile, flex_attention materialises every score: compiling is what saves.
        _compiled_flex = torch.compile(_flex_module().flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask)


def local_self_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: LocalLayout,
    *,
    dropout_p: float = 0.0,
    use_flex: bool | None = None,
) -> torch.Tensor:
    """softmax(Q K^T / sqrt(hd)) V over the pairs ``layout`` allows, for all heads at once.

    Args:
        q, k, v: ``(B, H, L, hd)`` with ``L == layout.length``.
        layout: which pairs may attend.
        dropout_p: dropout on the attention weights (pass 0.0 in eval mode).
        use_flex: ``None`` (default) uses compiled FlexAttention when :func:`flex_unsupported_reason`
            finds nothing against it and falls back to SDPA with the dense mask otherwise (also,
            with a warning, when compiling fails); ``True`` requires FlexAttention (``ValueError``
            saying why when it cannot run); ``False`` always uses the dense mask.

    Returns:
        ``(B, H, L, hd)``.
    """
    global _flex_broken
    if q.dim() != 4 or k.shape[-2] != q.shape[-2] or v.shape[-2] != q.shape[-2]:
        shapes = ", ".join(str(tuple(t.shape)) for t in (q, k, v))
        raise ValueError(f"q, k, v must be (B, H, L, hd) of one length, got {shapes}")
    if q.shape[-2] != layout.length:
        raise ValueError(f"the layout is for {layout.length} tokens, q has {q.shape[-2]}")
    reason = flex_unsupported_reason(q, k, v, dropout_p=dropout_p) if use_flex is not False else "use_flex=False"
    if use_flex and reason is not None:
        raise ValueError(f"use_flex=True, but {reason}")
    if reason is None:
        try:
            return _flex(q, k, v, layout.block_mask(q.device))
        except Exception as err:  # compiling needs a working compiler toolchain; fall back once, loudly
            if use_flex:
                raise
            _flex_broken = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
            warnings.warn(f"FlexAttention failed, using dense masks from now on: {_flex_broken}", RuntimeWarning)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=layout.dense(q.device), dropout_p=dropout_p)


# ------------------------------------------------------------------------------ the layer
class LocalSelfAttention(SelfAttention):
    """Multi-head self-attention of a sequence over itself, restricted to the pairs of a layout.

    For long inputs: a sliding window over text, a 2-D neighbourhood over image patches
    (:func:`grid_neighbourhood`), a block-sparse layout. A :class:`~vlfuse.layers.SelfAttention`
    (the same parameters, options and call) whose queries see only the keys the layout allows: it
    stands in wherever one is called as ``attn(x, mask=padding)``, e.g. as a FusionBlock's
    ``self_attn``, and a SelfAttention's weights load into it (``load_state_dict``).

    Without a padding mask, with the softmax normaliser and without weights, a call runs
    :func:`local_self_attention` (compiled FlexAttention where it can: inference, no dropout).
    Otherwise it runs :func:`~vlfuse.layers.attention.attention_core` with the layout's dense mask
    combined with the padding mask; a query left with no key (its whole window is padding) gets a
    zero output, never NaN (:class:`~vlfuse.layers.attention.KeyMask`).

    Args:
        dim: width of the tokens.
        num_heads: number of attention heads.
        layout: which (query, key) pairs may attend; inputs have ``layout.length`` tokens.
        dropout, bias, normalizer, output_gate: as for :class:`~vlfuse.layers.SelfAttention`.

    Attributes:
        use_flex: ``use_flex`` of :func:`local_self_attention` (``None``: FlexAttention when it can).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 16,
        *,
        layout: LocalLayout,
        dropout: float = 0.0,
        bias: bool = True,
        normalizer: Normalizer = "softmax",
        output_gate: bool = False,
    ) -> None:
        super().__init__(dim, num_heads, dropout=dropout, bias=bias, normalizer=normalizer, output_gate=output_gate)
        self.layout = layout
        self.use_flex: bool | None = None

    def forward(
        self, x: torch.Tensor, *, mask: torch.Tensor | None = None, need_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Attend from each token of ``x`` to the tokens of ``x`` that the layout allows.

        Args:
            x: ``(B, L, dim)`` tokens, ``L = layout.length``.
            mask: ``(B, L)`` bool, True for real (non-padding) tokens.
            need_weights: also return the ``(B, H, L, L)`` weights (explicit path, dense mask).

        Returns:
            ``(B, L, dim)``, or ``(output, weights)`` when ``need_weights`` is set.
        """
        if x.dim() != 3 or x.shape[1] != self.layout.length:
            raise ValueError(f"x must be (batch, {self.layout.length}, {self.dim}) for {self.layout.name!r}, "
                             f"got shape {tuple(x.shape)}")
        self.check_tokens(x, mask)
        kv = self.project_context(x, mask)
        if mask is None and self.normalize is softmax_normalize and not need_weights:
            q = self.split_heads(self.q_proj(x))  # (B, H, L, hd)
            dropout_p = self.dropout if self.training else 0.0
            out = local_self_attention(q, kv.key, kv.value, self.layout, dropout_p=dropout_p, use_flex=self.use_flex)
            b, h, length, hd = out.shape
            return self.project_out(out.transpose(1, 2).reshape(b, length, h * hd), x, None)  # from (B, L, H * hd)
        allowed = self.layout.dense(x.device)[None]  # (1, L, L)
        key_mask = KeyMask(allowed if mask is None else allowed & mask[:, None, :])  # (B or 1, L, L)
        out, weights = self.attend(x, kv.key, kv.value, key_mask, need_weights=need_weights)
        return (out, weights) if need_weights else out

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, layout={self.layout.name!r}"
