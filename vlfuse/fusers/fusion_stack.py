"""The fusion stack: N fusion blocks in which every question token reads the image through 16-head
cross-attention (the default fuser)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Literal, Sequence

import torch

from vlfuse.fusers.base import FUSERS, Fused, Fuser, FuserConfig
from vlfuse.layers import CrossAttention, FusionStack, ProjectedContext, head_diversity
from vlfuse.layers.attention import ContextTokens
from vlfuse.parts import MAX_HEADS, MAX_LAYERS, check_mlp_ratio, check_range


@FUSERS.register
@dataclass
class FusionStackConfig(FuserConfig):
    """A stack of :class:`~vlfuse.layers.FusionBlock` s over the text encoder's states (``type: fusion_stack``).

    Attributes:
        depth: number of fusion blocks.
        heads: attention heads per block.
        mlp_ratio: hidden width of the MLPs as a multiple of the fusion width.
        mlp: the MLP of each block, a name of :data:`vlfuse.layers.MLP_LAYERS`: ``swiglu`` (gated:
            products of features, e.g. "negated" x "colour found") or ``gelu``.
        output_gate: each question token gates what each head read (see
            :class:`~vlfuse.layers.attention.OutputGate`).
        self_attention: each block starts with text self-attention (the text encoder already
            mixes the question's tokens).
        gated: the cross-attention and MLP branches go through tanh gates initialised to 0
            (Flamingo's way of protecting a pretrained path; a model trained from scratch has none).
        normalizer: how the attentions turn scores into weights: ``softmax`` (the fast SDPA path)
            or ``leaky_relu`` (linear in the scores; the explicit path).
        dropout: dropout on the residual branches.
        attn_dropout: dropout on the attention weights.
        diversity_weight: weight of the head-diversity penalty (the mean pairwise cosine
            similarity of the cross-attention heads' distributions, averaged over layers) added to
            the training loss; 0 turns it off. When on, every layer takes the explicit attention
            path in training, to materialise its weights.
    """

    type: str = "fusion_stack"
    depth: int = 2
    heads: int = 16
    mlp_ratio: float = 2.0
    mlp: Literal["gelu", "swiglu"] = "swiglu"
    output_gate: bool = True
    self_attention: bool = False
    gated: bool = False
    normalizer: Literal["softmax", "leaky_relu"] = "softmax"
    dropout: float = 0.0
    attn_dropout: float = 0.0
    diversity_weight: float = 0.0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_range("fuser.depth", self.depth, 1, MAX_LAYERS)
        check_range("fuser.heads", self.heads, 1, MAX_HEADS)
        check_mlp_ratio("fuser.mlp_ratio", self.mlp_ratio)
        if self.diversity_weight < 0:
            raise ValueError(f"fuser.diversity_weight must be >= 0, got {self.diversity_weight}")

    def build(self, dim: int, *, text_width: int, grid_size: tuple[int, int]) -> "FusionStackFuser":
        return FusionStackFuser(self, dim)


class FusionStackFuser(Fuser):
    """The text encoder's states, projected, read the image through a :class:`~vlfuse.layers.FusionStack`.

    The image context is every block's keys and values, projected once per image; with activation
    checkpointing in training, the image tokens, from which each block projects its own inside its
    checkpoint (see :class:`~vlfuse.layers.FusionStack`).

    Args:
        config: its options.
        dim: the fusion width.
    """

    supports_grad_checkpointing = True

    def __init__(self, config: FusionStackConfig, dim: int) -> None:
        super().__init__()
        self.diversity_weight = config.diversity_weight
        self.stack = FusionStack(
            config.depth,
            dim,
            config.heads,
            mlp_ratio=config.mlp_ratio,
            dropout=config.dropout,
            attn_dropout=config.attn_dropout,
            self_attention=config.self_attention,
            gated=config.gated,
            attention_normalizer=config.normalizer,
            output_gate=config.output_gate,
            mlp_layer=config.mlp,
        )

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Checkpoint every fusion block (:meth:`FusionStack.set_grad_checkpointing <vlfuse.layers.FusionStack.set_grad_checkpointing>`)."""
        self.stack.set_grad_checkpointing(enable)

    @property
    def attention_layers(self) -> list[CrossAttention]:
        return [block.cross_attn for block in self.stack.blocks]

    def image_context(self, image_tokens: torch.Tensor, num_prefix_tokens: int) -> list[ProjectedContext | ContextTokens]:
        """Every block's keys/values ``(Bi, H, Li, hd)`` of all the image tokens (prefix tokens too);
        while the blocks run checkpointed, the image tokens for every block to project itself."""
        if self.stack.checkpointing:
            return [ContextTokens(image_tokens)] * len(self.stack)
        return self.stack.project_context(image_tokens)

    def forward(
        self,
        text: torch.Tensor,
        text_mask: torch.Tensor,
        image_context: list[ProjectedContext | ContextTokens],
        image_index: torch.Tensor | None = None,
        *,
        head_masks: Sequence[torch.Tensor | None] | None = None,
        weights_from: Iterable[int] = (),
    ) -> Fused:
        wanted = set(weights_from)
        # The diversity penalty needs every layer's weights: only then do all layers leave SDPA.
        diversity_layers = range(len(self.stack)) if self.training and self.diversity_weight > 0 else ()
        tokens, attentions = self.stack(
            text,
            text_mask=text_mask,
            kvs=image_context,
            image_index=image_index,
            weights_from=wanted.union(diversity_layers),
            head_masks=head_masks,
        )
        if not diversity_layers:
            return Fused(tokens, attentions)
        diversity = torch.stack([head_diversity(attentions[i], text_mask) for i in diversity_layers]).mean()
        attentions = {i: w for i, w in attentions.items() if i in wanted}
        return Fused(tokens, attentions, diversity, self.diversity_weight * diversity)
