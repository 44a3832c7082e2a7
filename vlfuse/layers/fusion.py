"""Fusion blocks: text tokens read image tokens through gated cross-attention.

The blocks work on packed tokens (:class:`~vlfuse.layers.packing.PackedTokens`): every per-token
step runs on the real question tokens alone, and attention once per image over the tokens of all
its questions. Padding positions pass through a block unchanged. Inputs are checked once, where
they enter (:meth:`FusionBlock.forward`, :meth:`FusionStack.forward`); the packed path trusts them.

Under ``torch.export`` and ``torch.compile`` the blocks run on the padded reference layout instead
(:class:`~vlfuse.layers.packing.PaddedTokens`, chosen by :func:`layout_of`): packing's sizes depend
on the text mask's values, which neither can trace.

:meth:`FusionStack.set_grad_checkpointing` recomputes each block in backward (activation
checkpointing, ``torch.utils.checkpoint``, non-reentrant) instead of keeping its activations.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vlfuse.layers.attention import (
    ContextTokens, CrossAttention, Normalizer, ProjectedContext, SelfAttention, check_queries,
)
from vlfuse.layers.local_attention import LocalLayout, LocalSelfAttention
from vlfuse.layers.packing import PackedTokens, PaddedTokens


class Mlp(nn.Sequential):
    """The transformer MLP ``Linear -> GELU -> Linear`` (a Sequential: its weights are ``0.*`` and ``2.*``).

    Args:
        dim: input and output width.
        hidden: width of the inner projection.
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


class SwiGLU(nn.Module):
    """Gated MLP ``W_out (silu(x W_a) * (x W_b))`` (Shazeer, 2020, "GLU Variants Improve Transformer").

    The product of two projections of the same token gives the MLP multiplicative interactions
    between its features (e.g. "the question is negated" times "the colour asked about is there").

    Args:
        dim: input and output width.
        hidden: width of each of the two inner projections.
    """

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.inner = nn.Linear(dim, 2 * hidden)  # rows: [W_a; W_b]
        self.out = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.inner(x).chunk(2, dim=-1)  # each (..., hidden)
        return self.out(nn.functional.silu(gate) * value)


MLP_LAYERS: dict[str, type[nn.Module]] = {"gelu": Mlp, "swiglu": SwiGLU}
"""The MLPs a block can be built with by name (``mlp_layer="swiglu"``); a class ``(dim, hidden)`` works too."""


def mlp_layer_class(mlp_layer: str | type[nn.Module]) -> type[nn.Module]:
    """The MLP class ``mlp_layer`` names (a key of :data:`MLP_LAYERS`), or ``mlp_layer`` itself when it is a class."""
    if isinstance(mlp_layer, type):
        return mlp_layer
    if mlp_layer not in MLP_LAYERS:
        raise ValueError(f"mlp_layer must be one of {tuple(MLP_LAYERS)} or an nn.Module class, got {mlp_layer!r}")
    return MLP_LAYERS[mlp_layer]


class FusionBlock(nn.Module):
    """Pre-LayerNorm fusion block for text queries over image keys/values.

    ``x = x + self_attn(norm(x))`` (optional, with the text padding mask), then
    ``x = x + tanh(g_attn) * cross_attn(norm(x), image)``, then ``x = x + tanh(g_mlp) * mlp(norm(x))``.
    The tanh gates start at 0 (as in Flamingo), so a new block ignores the image and, without
    self-attention, is the identity. ``gated=False`` uses plain residuals instead.

    Args:
        dim: width of the text tokens.
        num_heads: heads of both attentions.
        kv_dim: width of the image tokens (default ``dim``).
        mlp_ratio: hidden width of the MLP as a multiple of ``dim``.
        dropout: dropout on the residual branches.
        attn_dropout: dropout on the attention weights.
        self_attention: include text self-attention (:class:`~vlfuse.layers.SelfAttention`) before
            the cross-attention.
        gated: multiply the cross-attention and MLP branches by tanh gates initialised to 0.
        attention_normalizer: ``"softmax"`` or ``"leaky_relu"``, for both attentions (see
            :class:`~vlfuse.layers.attention.MultiHeadAttention`).
        output_gate: both attentions gate their heads' outputs by the query (see
            :class:`~vlfuse.layers.attention.OutputGate`).
        mlp_layer: the MLP, by name (``"gelu"``: :class:`Mlp`; ``"swiglu"``: :class:`SwiGLU`, two
            inner projections of the same hidden width) or as a class built as ``cls(dim, hidden)``.
        self_attn_layout: restrict the text self-attention to a local layout (e.g.
            :func:`~vlfuse.layers.local_attention.sliding_window`): it is then a
            :class:`~vlfuse.layers.local_attention.LocalSelfAttention` (the same parameter names), and
            text rows must be padded to ``layout.length`` tokens. Default: full self-attention.
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 16,
        *,
        kv_dim: int | None = None,
        mlp_ratio: float = 4.0,
        dropout: float = 0.0,
        attn_dropout: float = 0.0,
        self_attention: bool = True,
        gated: bool = True,
        attention_normalizer: Normalizer = "softmax",
        output_gate: bool = False,
        mlp_layer: str | type[nn.Module] = "gelu",
        self_attn_layout: LocalLayout | None = None,
    ) -> None:
        super().__init__()
        if self_attn_layout is not None and not self_attention:
            raise ValueError("self_attn_layout given, but this block has no self-attention (self_attention=False)")
        mlp_class = mlp_layer_class(mlp_layer)
        attention = dict(dropout=attn_dropout, normalizer=attention_normalizer, output_gate=output_gate)
        if not self_attention:
            self.self_attn = None
        elif self_attn_layout is None:
            self.self_attn = SelfAttention(dim, num_heads, **attention)
        else:
            self.self_attn = LocalSelfAttention(dim, num_heads, layout=self_attn_layout, **attention)
        self.norm_self = nn.LayerNorm(dim) if self_attention else None
        self.norm_cross = nn.LayerNorm(dim)
        self.cross_attn = CrossAttention(dim, num_heads, kv_dim=kv_dim, **attention)
        self.norm_mlp = nn.LayerNorm(dim)
        self.mlp = mlp_class(dim, int(dim * mlp_ratio))
        self.drop = nn.Dropout(dropout)
        self.gate_attn = nn.Parameter(torch.zeros(1)) if gated else None
        self.gate_mlp = nn.Parameter(torch.zeros(1)) if gated else None

    @staticmethod
    def _gate(gate: nn.Parameter | None, branch: torch.Tensor) -> torch.Tensor:
        return branch if gate is None else gate.tanh() * branch

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        text_mask: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        kv: ProjectedContext | None = None,
        context_index: torch.Tensor | None = None,
        need_weights: bool = False,
        head_mask: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Fuse ``x`` ``(B, Lt, dim)`` with image tokens.

        Args:
            context: ``(Bi, Li, kv_dim)`` image tokens, or ``kv`` from ``cross_attn.project_context``.
            text_mask: ``(B, Lt)`` bool, True for real (non-padding) text tokens.
            context_mask: ``(Bi, Li)`` bool, True for image tokens that may be attended.
            context_index: ``(B,)`` the image of each text row when images are shared.
            need_weights: also return the cross-attention weights ``(B, H, Lt, Li)``.
            head_mask: ``(H,)`` or ``(B, H)`` factors on the cross-attention heads' outputs (see
                :meth:`~vlfuse.layers.CrossAttention.forward`).
        """
        kv = self.cross_attn.keys_values(context, context_mask, kv)
        check_queries(x, self.cross_attn.dim, kv, self.cross_attn.num_heads, context_index, head_mask)
        layout, [kv] = layout_of(x, text_mask, context_index, [kv])
        tokens, weights = self.forward_packed(
            layout.pack(x), kv, layout, need_weights=need_weights, head_mask=layout.per_token(head_mask)
        )
        out = layout.unpack(tokens, x)
        return (out, unpack_weights(weights, layout)) if need_weights else out

    def forward_packed(
        self,
        tokens: torch.Tensor,
        kv: ProjectedContext,
        layout: PackedTokens,
        *,
        need_weights: bool = False,
        head_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward` on the real tokens ``(N, dim)`` of ``layout``'s rows, each reading its image.

        Returns:
            ``(tokens (N, dim), cross-attention weights (N, H, Li) or None)``; ``head_mask``: ``(H,)`` or ``(N, H)``.
        """
        if self.self_attn is not None:  # over the padded rows, with the text mask
            rows = layout.to_rows(self.norm_self(tokens))  # (B, Lt, dim)
            tokens = tokens + self.drop(layout.pack(self.self_attn(rows, mask=layout.mask)))
        attended, weights = self.cross_attn.attend_packed(
            self.norm_cross(tokens), kv, layout.groups, need_weights=need_weights, head_mask=head_mask
        )
        tokens = tokens + self._gate(self.gate_attn, self.drop(attended))
        tokens = tokens + self._gate(self.gate_mlp, self.drop(self.mlp(self.norm_mlp(tokens))))
        return tokens, weights


def layout_of(
    x: torch.Tensor,
    text_mask: torch.Tensor | None,
    image_index: torch.Tensor | None,
    kvs: list[ProjectedContext | ContextTokens],
) -> tuple[PackedTokens, list[ProjectedContext | ContextTokens]]:
    """The layout of text ``x`` ``(B, Lt, dim)`` and the keys/values of each layer its groups read.

    In eager mode :class:`~vlfuse.layers.packing.PackedTokens` (the fast layout) and ``kvs`` as
    given. Under ``torch.compile`` or ``torch.export`` (:func:`torch.compiler.is_compiling`, True
    for both) :class:`~vlfuse.layers.packing.PaddedTokens`, whose sizes do not depend on the data,
    with each image's keys/values copied to the rows that read it (``image_index`` ``(B,)``).
    """
    if not torch.compiler.is_compiling():
        return PackedTokens.of(x, text_mask, image_index, kvs[0].batch_size), kvs
    if image_index is not None:
        kvs = [kv.rows(image_index) for kv in kvs]
    return PaddedTokens(x.shape[0], x.shape[1], text_mask, device=x.device), kvs


def unpack_weights(weights: torch.Tensor, layout: PackedTokens) -> torch.Tensor:
    """Packed weights ``(N, H, Li) -> (B, H, Lt, Li)``, zero at padding positions."""
    padding = weights.new_zeros(layout.batch, layout.length, *weights.shape[1:])  # (B, Lt, H, Li)
    return layout.unpack(weights, padding).transpose(1, 2)


class FusionStack(nn.Module):
    """``depth`` FusionBlocks applied in turn; keyword arguments go to every block.

    Image keys/values can be projected once for all layers with :meth:`project_context` and
    shared between several questions about one image through ``image_index``.

    With :meth:`set_grad_checkpointing`, each block runs in training under a non-reentrant
    ``torch.utils.checkpoint``: backward keeps the block's inputs and recomputes the rest. Given the
    image tokens (``context``) rather than ``kvs``, each block then projects its keys/values inside
    its checkpoint, so that backward keeps the image tokens once instead of every block's keys and
    values (``(Bi, H, Li, hd)`` twice per block: the largest tensors of the stack).
    """

    def __init__(self, depth: int, dim: int, num_heads: int = 16, **block_kwargs) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.blocks = nn.ModuleList(FusionBlock(dim, num_heads, **block_kwargs) for _ in range(depth))
        self.grad_checkpointing = False

    def __len__(self) -> int:
        return len(self.blocks)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in backward instead of keeping them (in training, with
        gradients enabled; evaluation and inference run as before)."""
        self.grad_checkpointing = enable

    @property
    def checkpointing(self) -> bool:
        """Whether the blocks run checkpointed now: switched on, in training, with gradients enabled."""
        return self.grad_checkpointing and self.training and torch.is_grad_enabled()

    def project_context(self, context: torch.Tensor, context_mask: torch.Tensor | None = None) -> list[ProjectedContext]:
        """Keys/values of ``context`` ``(B, Li, kv_dim)`` for every layer."""
        return [block.cross_attn.project_context(context, context_mask) for block in self.blocks]

    def forward(
        self,
        x: torch.Tensor,
        context: torch.Tensor | None = None,
        *,
        text_mask: torch.Tensor | None = None,
        context_mask: torch.Tensor | None = None,
        kvs: list[ProjectedContext] | None = None,
        image_index: torch.Tensor | None = None,
        weights_from: Iterable[int] = (),
        head_masks: Sequence[torch.Tensor | None] | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run every block.

        Args:
            x: ``(B, Lt, dim)`` text tokens.
            context / context_mask: image tokens ``(Bi, Li, kv_dim)`` and mask, or ``kvs``; each
                block projects its keys/values from ``context`` as it runs (inside its checkpoint).
            image_index: ``(B,)`` the image row of each text row, when ``Bi != B``.
            weights_from: layer indices whose cross-attention weights to return; only those
                layers leave the fast path.
            head_masks: one entry per block, each ``None`` or that block's cross-attention
                ``head_mask`` (``(H,)`` or ``(B, H)`` over its heads present).

        Returns:
            ``(x, {layer: weights (B, H, Lt, Li)})``.
        """
        if kvs is None:
            if context is None:
                raise ValueError("pass context or kvs")
            kvs = [ContextTokens(context, context_mask)] * len(self.blocks)
        elif context is not None or context_mask is not None:
            raise ValueError("pass either context (with context_mask) or kvs, not both")
        if len(kvs) != len(self.blocks):
            raise ValueError(f"got keys/values for {len(kvs)} layers, the stack has {len(self.blocks)}")
        if head_masks is None:
            head_masks = [None] * len(self.blocks)
        elif len(head_masks) != len(self.blocks):
            raise ValueError(f"got head masks for {len(head_masks)} layers, the stack has {len(self.blocks)}")
        for block, kv, head_mask in zip(self.blocks, kvs, head_masks):
            check_queries(x, block.cross_attn.dim, kv, block.cross_attn.num_heads, image_index, head_mask)
        wanted = set(weights_from)
        layout, kvs = layout_of(x, text_mask, image_index, kvs)
        tokens = layout.pack(x)  # (N, dim)
        weights: dict[int, torch.Tensor] = {}
        checkpointing = self.checkpointing
        for i, (block, kv, head_mask) in enumerate(zip(self.blocks, kvs, head_masks)):
            step = (block, tokens, kv, layout, i in wanted, layout.per_token(head_mask))
            if checkpointing:
                tokens, layer_weights = checkpoint(run_block, *step, use_reentrant=False)
            else:
                tokens, layer_weights = run_block(*step)
            if layer_weights is not None:
                weights[i] = unpack_weights(layer_weights, layout)
        return layout.unpack(tokens, x), weights


def run_block(
    block: FusionBlock,
    tokens: torch.Tensor,
    kv: ProjectedContext | ContextTokens,
    layout: PackedTokens,
    need_weights: bool,
    head_mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:meth:`FusionBlock.forward_packed`, after projecting ``kv`` when it is :class:`ContextTokens`
    (in the stack's checkpoint, the projection is recomputed in backward with the block)."""
    kv = block.cross_attn.keys_values(kv=kv)
    return block.forward_packed(tokens, kv, layout, need_weights=need_weights, head_mask=head_mask)
