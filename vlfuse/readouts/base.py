"""The readout interface and its registry: what turns the question tokens into answer scores."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from vlfuse.encoders import TextEncoder
    from vlfuse.model import VLFuseConfig

READOUTS: dict[str, type["Readout"]] = {}
"""The readouts a config can name (``VLFuseConfig.readout``), by name."""


def register_readout(cls: type["Readout"]) -> type["Readout"]:
    """Class decorator: make ``cls`` selectable as ``readout: <cls.name>`` in a config."""
    if cls.name in READOUTS:
        raise ValueError(f"a readout named {cls.name!r} is already registered ({READOUTS[cls.name].__qualname__})")
    READOUTS[cls.name] = cls
    return cls


def get_readout(name: str) -> type["Readout"]:
    """The readout class registered as ``name``; the error lists the names there are."""
    if name not in READOUTS:
        raise ValueError(f"readout must be one of {sorted(READOUTS)}, got {name!r}")
    return READOUTS[name]


def encode_distinct(text_encoder: "TextEncoder", input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Text encoder states ``(Bq, Lt, width)``, computed once per distinct question in the batch.

    Datasets repeat questions (easy-VQA has a few hundred distinct ones); the encoder output
    depends on the question alone, so duplicates are gathered, not recomputed. Gradients flow
    back through the gather to every use. The gather is ``index_select``, whose backward adds
    each use's gradient in a fixed order: ``states[inverse]`` adds them with parallel atomic adds
    on CPU (2+ threads), so the same step gave different text-encoder gradients from run to run.
    """
    tokens = torch.cat([input_ids, attention_mask.to(input_ids.dtype)], dim=1)  # (Bq, 2 * Lt)
    distinct, inverse = torch.unique(tokens, dim=0, return_inverse=True)
    if len(distinct) == len(tokens):
        return text_encoder(input_ids, attention_mask)
    ids, mask = distinct.split(input_ids.shape[1], dim=1)
    return text_encoder(ids, mask).index_select(0, inverse)


class Readout(nn.Module):
    """Turns the question tokens, fused with the image or not, into answer scores.

    A readout is one interchangeable part of :class:`~vlfuse.model.VLFuseModel`, chosen by name
    (``VLFuseConfig.readout``) among the classes registered with :func:`register_readout`, the way
    timm injects its attention and MLP layers. The model calls, in order:
    :meth:`question_features` (what it reads of the question), :meth:`image_context` (what it
    needs of each image, computed once per image) and :meth:`forward` (the answer scores).

    Class attributes:
        name: the name a config selects it by.
        reads_fusion: ``True``: it reads the output of the model's fusion blocks (``fusion_depth``
            at least 1); ``False``: it reads the question and the image itself and the model has
            no fusion blocks (``fusion_depth`` 0), so every fusion option is left unused.
        options: the :class:`~vlfuse.model.VLFuseConfig` fields it reads itself (the fusion
            stack's own are known to the model); a field used by no part must stay at its default.
        format_v1_keys: ``{prefix in a format-1 file: prefix in the model}`` for its weights,
            which format 1 kept at the top level of the model.

    Args:
        config: the model's architecture.
        answers: the answer vocabulary.
        text_width: width of the text encoder's states.
        grid_size: ``(rows, cols)`` of the image encoder's patch grid.
    """

    name: ClassVar[str]
    reads_fusion: ClassVar[bool] = True
    options: ClassVar[tuple[str, ...]] = ()
    format_v1_keys: ClassVar[dict[str, str]] = {}

    def __init__(
        self, config: "VLFuseConfig", answers: Sequence[str], *, text_width: int, grid_size: tuple[int, int]
    ) -> None:
        super().__init__()

    @classmethod
    def check(cls, config: "VLFuseConfig", answers: Sequence[str]) -> None:
        """Raise a ``ValueError`` naming what of ``config`` or ``answers`` this readout cannot work with."""

    def question_features(
        self, text_encoder: "TextEncoder", input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> torch.Tensor:
        """What it reads of the question, ``(Bq, Lt, text width)``: the text encoder's states."""
        return encode_distinct(text_encoder, input_ids, attention_mask)

    def image_context(self, image_tokens: torch.Tensor, num_prefix_tokens: int) -> Any:
        """What it needs of the images ``(Bi, Li, fusion_dim)`` besides the fusion stack: ``None``.

        Whatever it returns (a tensor or a dataclass of tensors, batch first) is computed once per
        image and shared by the questions about it.
        """
        return None

    def forward(
        self,
        tokens: torch.Tensor,
        text_mask: torch.Tensor,
        image_context: Any,
        image_index: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Answer scores ``(Bq, num_answers)``.

        Args:
            tokens: ``(Bq, Lt, fusion_dim)`` the question tokens: fused with the image when
                :attr:`reads_fusion`, else the projected :meth:`question_features`.
            text_mask: ``(Bq, Lt)`` True for real (non-padding) tokens.
            image_context: what :meth:`image_context` returned for the images.
            image_index: ``(Bq,)`` the image of each question (default: question i, image i).
        """
        raise NotImplementedError
