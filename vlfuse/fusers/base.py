"""The fuser interface and its registry: what reads the question together with the image."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Sequence

import torch
from torch import nn

from vlfuse.layers import CrossAttention
from vlfuse.parts import TOKENS, PartConfig, Registry

if TYPE_CHECKING:
    from vlfuse.encoders import TextEncoder

FUSERS: Registry = Registry("fuser", default="fusion_stack")
"""The fusers a model config can name (``fuser: {type: ...}``), by type."""

@dataclass
class FuserConfig(PartConfig):
    """Base of a fuser's config (see :mod:`vlfuse.parts`); ``build`` makes the fuser.

    Class attributes:
        reads_words: the fuser reads the question's word embeddings, not the text encoder's
            layers (a from-scratch text encoder must then have depth 0).
        gives: what it hands the head: :data:`TOKENS` or :data:`EVIDENCE`.
    """

    reads_words: ClassVar[bool] = False
    gives: ClassVar[str] = TOKENS

    def build(self, dim: int, *, text_width: int, grid_size: tuple[int, int]) -> "Fuser":
        """The fuser, over question and image tokens of width ``dim`` (the text encoder's states are
        ``text_width`` wide; the image's patch grid is ``grid_size``)."""
        raise NotImplementedError


@dataclass
class Fused:
    """What a fuser returns.

    Attributes:
        output: what the head reads: ``(Bq, Lt, dim)`` question tokens fused with the image
            (:data:`TOKENS`), or ``(Bq,)`` evidence (:data:`EVIDENCE`).
        attentions: ``{layer: (Bq, H, Lt, Li)}`` cross-attention weights of the layers asked for.
        head_diversity: the head-diversity penalty when it is computed (training, weight > 0), else ``None``.
        auxiliary_loss: what the fuser adds to the training loss (the weighted penalty), else ``None``.
    """

    output: torch.Tensor
    attentions: dict[int, torch.Tensor]
    head_diversity: torch.Tensor | None = None
    auxiliary_loss: torch.Tensor | None = None


def encode_distinct(text_encoder: "TextEncoder", input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Text encoder states ``(Bq, Lt, width)``, computed once per distinct question in the batch.

    Datasets repeat questions (easy-VQA has a few hundred distinct ones); the encoder output
    depends on the question alone, so duplicates are gathered, not recomputed. Gradients flow
    back through the gather to every use. The gather is ``index_select``, whose backward adds
    each use's gradient in a fixed order: ``states[inverse]`` adds them with parallel atomic adds
    on CPU (2+ threads), so the same step gave different text-encoder gradients from run to run.
    """
    if torch.compiler.is_compiling():  # the number of distinct questions is data: export and compile run every row
        return text_encoder(input_ids, attention_mask)
    tokens = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)  # (Bq, 2 * Lt)
    distinct, inverse = torch.unique(tokens, dim=0, return_inverse=True)
    if len(distinct) == len(tokens):
        return text_encoder(input_ids, attention_mask)
    ids, mask = distinct.split(input_ids.shape[1], dim=1)
    return text_encoder(ids, mask).index_select(0, inverse)


class Fuser(nn.Module):
    """Reads the question tokens together with the image: the part between the encoders and the head.

    One interchangeable part of :class:`~vlfuse.model.VLFuseModel`, chosen by the ``type`` of its
    config (:data:`FUSERS`). The model calls, in order: :meth:`question_features` (what it reads of
    the question, before the model's ``text_proj``), :meth:`image_context` (what it needs of each
    image, computed once per image and shared by every question about it) and :meth:`forward`.

    A fuser with cross-attention heads lists them in :attr:`attention_layers`; the model's head
    masks, attention maps, head scores and pruning (``vlfuse analyze``, ``vlfuse prune``) work
    through that list, whatever the fuser.

    A fuser whose :attr:`supports_grad_checkpointing` is True recomputes its blocks in backward
    after :meth:`set_grad_checkpointing` (activation checkpointing).
    """

    supports_grad_checkpointing: ClassVar[bool] = False
    """Whether :meth:`set_grad_checkpointing` can switch activation checkpointing on."""

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Recompute the fuser's activations in backward instead of keeping them (in training, with
        gradients enabled). This one has no blocks to checkpoint: switching it on is a ValueError."""
        if enable:
            raise ValueError(f"{type(self).__name__} has no blocks to checkpoint")

    def question_features(
        self, text_encoder: "TextEncoder", input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """What it reads of the question, ``(Bq, Lt, text width)``: the text encoder's states."""
        return encode_distinct(text_encoder, input_ids, attention_mask)

    def image_context(self, image_tokens: torch.Tensor, num_prefix_tokens: int) -> Any:
        """What it needs of the images ``(Bi, Li, dim)``: a tensor, or a list or dataclass of them,
        batch first (it is sliced and concatenated image by image)."""
        raise NotImplementedError

    @property
    def attention_layers(self) -> list[CrossAttention]:
        """Its cross-attention layers, in order: the heads that can be masked, drawn, scored and pruned."""
        return []

    def attended_prefix_tokens(self, num_prefix_tokens: int) -> int:
        """How many prefix tokens (CLS, registers) begin the keys of its attention layers, of the
        image encoder's ``num_prefix_tokens``: all of them, the keys being every image token."""
        return num_prefix_tokens

    def forward(
        self,
        text: torch.Tensor,
        text_mask: torch.Tensor,
        image_context: Any,
        image_index: torch.Tensor | None = None,
        *,
        head_masks: Sequence[torch.Tensor | None] | None = None,
        weights_from: Iterable[int] = (),
    ) -> Fused:
        """Fuse the question tokens with their images.

        Args:
            text: ``(Bq, Lt, dim)`` the projected :meth:`question_features`.
            text_mask: ``(Bq, Lt)`` True for real (non-padding) tokens.
            image_context: what :meth:`image_context` returned for the images.
            image_index: ``(Bq,)`` the image of each question (default: question i, image i).
            head_masks: per layer of :attr:`attention_layers`, ``None`` or ``(H,)`` / ``(Bq, H)``
                factors on its heads' outputs (over the heads present).
            weights_from: layers of :attr:`attention_layers` whose cross-attention weights to return.
        """
        raise NotImplementedError
