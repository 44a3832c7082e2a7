"""The caption decoder: word and position embeddings, causal fusion blocks, a tied language-model head.

The head of :class:`~vlfuse.captioning.CaptionModel`: it writes words instead of scoring answers."""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from vlfuse.layers import FusionBlock, ProjectedContext
from vlfuse.layers.attention import ContextTokens
from vlfuse.layers.causal import CausalSelfAttention, KVCache


class CaptionBlock(nn.Module):
    """A fusion block whose text self-attention is causal: ``x + self_attn(norm(x))``, then a
    :class:`~vlfuse.layers.FusionBlock` without self-attention (cross-attention to the image, MLP).

    Args:
        dim: width of the text tokens.
        num_heads: heads of both attentions.
        dropout: dropout on the residual branches.
        attn_dropout: dropout on the attention weights.
        **block_options: the :class:`~vlfuse.layers.FusionBlock` options (``kv_dim``, ``mlp_ratio``,
            ``gated``, ...).
    """

    def __init__(self, dim: int, num_heads: int = 16, *, dropout: float = 0.0, attn_dropout: float = 0.0, **block_options) -> None:
        super().__init__()
        self.norm_self = nn.LayerNorm(dim)
        self.self_attn = CausalSelfAttention(dim, num_heads, dropout=attn_dropout)
        self.drop = nn.Dropout(dropout)
        self.fusion = FusionBlock(
            dim, num_heads, self_attention=False, dropout=dropout, attn_dropout=attn_dropout, **block_options
        )

    def forward(
        self,
        x: torch.Tensor,
        kv: ProjectedContext | ContextTokens,
        *,
        image_index: torch.Tensor | None = None,
        cache: KVCache | None = None,
        need_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``(B, Lt, dim)`` text tokens that follow those in ``cache``; ``kv`` the image keys/values
        from ``fusion.cross_attn.project_context`` (or the image tokens, projected here); ``image_index``
        ``(B,)`` the image row of each text row.
        With ``need_weights``, also the cross-attention weights ``(B, H, Lt, Li)``."""
        x = x + self.drop(self.self_attn(self.norm_self(x), cache=cache))
        return self.fusion(x, kv=kv, context_index=image_index, need_weights=need_weights)


class DecoderCache(list):
    """One :class:`~vlfuse.layers.causal.KVCache` per decoder block: the state of step-by-step decoding."""

    @classmethod
    def empty(cls, depth: int) -> "DecoderCache":
        return cls(KVCache() for _ in range(depth))

    @property
    def length(self) -> int:
        """Tokens decoded so far."""
        return self[0].length

    def select(self, rows: torch.Tensor) -> None:
        """Keep the rows ``rows`` of every layer (beam search)."""
        for layer in self:
            layer.select(rows)


@dataclass
class DecoderOutput:
    """What :meth:`CaptionDecoder.forward` returns.

    Attributes:
        logits: ``(B, Lt, vocab)`` next-token scores at each position.
        attentions: ``{layer: (B, H, Lt, Li)}`` cross-attention weights of the layers asked for.
    """

    logits: torch.Tensor
    attentions: dict[int, torch.Tensor]


class CaptionDecoder(nn.Module):
    """Word embeddings plus learned positions, ``depth`` :class:`CaptionBlock` s, a final norm and a
    language-model head that shares the word-embedding matrix.

    Args:
        vocab_size: words of the tokenizer.
        max_length: positions (the longest token sequence, begin and end tokens included).
        dim: width of the tokens.
        depth: number of blocks.
        num_heads: heads of every attention.
        kv_dim: width of the image tokens.
        dropout: dropout on the embeddings and on the residual branches.
        **block_options: further :class:`CaptionBlock` options.

    With :meth:`set_grad_checkpointing`, teacher forcing in training runs each block under a
    non-reentrant ``torch.utils.checkpoint``, its image keys/values projected inside it (as
    :class:`~vlfuse.layers.FusionStack` does).
    """

    def __init__(
        self,
        vocab_size: int,
        max_length: int,
        dim: int,
        depth: int,
        num_heads: int = 16,
        *,
        kv_dim: int | None = None,
        dropout: float = 0.0,
        **block_options,
    ) -> None:
        super().__init__()
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        self.max_length = max_length
        self.embed = nn.Embedding(vocab_size, dim)
        self.positions = nn.Embedding(max_length, dim)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(
            CaptionBlock(dim, num_heads, kv_dim=kv_dim, dropout=dropout, **block_options) for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.grad_checkpointing = False

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute each block's activations in backward instead of keeping them (in training, with
        gradients enabled, without a cache: teacher forcing)."""
        self.grad_checkpointing = enable

    @property
    def checkpointing(self) -> bool:
        """Whether the blocks run checkpointed now: switched on, in training, with gradients enabled."""
        return self.grad_checkpointing and self.training and torch.is_grad_enabled()

    def project_context(self, image_tokens: torch.Tensor) -> list[ProjectedContext | ContextTokens]:
        """Image tokens ``(Bi, Li, kv_dim)`` -> every block's cross-attention keys/values, computed once;
        while the blocks run checkpointed, the image tokens for every block to project itself."""
        if self.checkpointing:
            return [ContextTokens(image_tokens)] * len(self.blocks)
        return [block.fusion.cross_attn.project_context(image_tokens) for block in self.blocks]

    def forward(
        self,
        input_ids: torch.Tensor,
        kvs: list[ProjectedContext],
        *,
        image_index: torch.Tensor | None = None,
        cache: DecoderCache | None = None,
        weights_from: tuple[int, ...] | list[int] | range = (),
    ) -> DecoderOutput:
        """Next-token scores for ``input_ids`` ``(B, Lt)``, the tokens that follow those in ``cache``.

        Args:
            kvs: from :meth:`project_context`, one per block.
            image_index: ``(B,)`` the image row of each text row, when rows share images (beams).
            cache: the keys/values of the tokens decoded before (filled in place); ``None``: the
                tokens start at position 0 (teacher forcing).
            weights_from: blocks whose cross-attention weights to return.
        """
        start = 0 if cache is None else cache.length
        end = start + input_ids.shape[1]
        if end > self.max_length:
            raise ValueError(f"the decoder has {self.max_length} positions, asked for position {end - 1}")
        positions = torch.arange(start, end, device=input_ids.device)
        x = self.drop(self.embed(input_ids) + self.positions(positions))  # (B, Lt, dim)
        wanted, attentions = set(weights_from), {}
        checkpointing = self.checkpointing and cache is None
        for i, (block, kv) in enumerate(zip(self.blocks, kvs, strict=True)):
            layer_cache = None if cache is None else cache[i]
            run = partial(checkpoint, block, use_reentrant=False) if checkpointing else block
            if i in wanted:
                x, attentions[i] = run(x, kv, image_index=image_index, cache=layer_cache, need_weights=True)
            else:
                x = run(x, kv, image_index=image_index, cache=layer_cache)
        logits = F.linear(self.norm(x), self.embed.weight)  # (B, Lt, vocab): the head is the embedding
        return DecoderOutput(logits, attentions)
