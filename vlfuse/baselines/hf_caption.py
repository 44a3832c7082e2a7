"""Hugging Face transformers' caption model as a peer of vlfuse's, built from its configs, from scratch.

:class:`HFCaptionPeer` wraps ``VisionEncoderDecoderModel``: a ``ViTModel`` encodes the image and a
``BertLMHeadModel`` (``is_decoder=True``, ``add_cross_attention=True``) writes the words, each of
its layers cross-attending to the patches (through the model's ``enc_to_dec_proj`` when the two
widths differ). :meth:`HFCaptionPeer.from_caption_config` sizes it as a vlfuse
:class:`~vlfuse.captioning.CaptionConfig` (same image size, patches, encoder width and depth, decoder
width, depth, heads, MLP ratio, positions) and gives it the same word-level tokenizer, so that
both models read the same pixels and predict the same token ids.

It follows :class:`~vlfuse.captioning.CaptionModel`'s calling convention where training needs it
(``tokenize``, ``forward(pixel_values, input_ids)`` -> next-token scores, ``pad_id``), so that
:class:`~vlfuse.captioning.lit.CaptionLitModule`'s loss and optimiser train it unchanged; captions
come from transformers' ``generate`` (greedy, its key/value cache on).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn
from transformers import BertConfig, BertLMHeadModel, ViTConfig, ViTModel, VisionEncoderDecoderModel
from transformers.utils.constants import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD

from vlfuse.baselines.hf_vqa import PixelNormalizer
from vlfuse.captioning.model import CaptionConfig, CaptionTokens, caption_processor
from vlfuse.encoders import build_word_tokenizer
from vlfuse.processor import VLFuseProcessor

VIT_MLP_RATIO = 4
"""Hidden width of the ViT's MLP as a multiple of its width (timm's ``vit_tiny_patch16_224`` too)."""


def vit_config(config: CaptionConfig) -> ViTConfig:
    """The ViT of ``config.image``: same image size, patch size, width, depth and heads."""
    image = config.image
    if image.image_size is None or image.patch_size is None or image.width is None:
        raise ValueError(f"caption_model.image needs image_size, patch_size and width to size the peer's ViT, got {image}")
    return ViTConfig(
        image_size=image.image_size,
        patch_size=image.patch_size,
        hidden_size=image.width,
        num_hidden_layers=image.depth,
        num_attention_heads=image.num_heads,
        intermediate_size=image.width * VIT_MLP_RATIO,
        hidden_dropout_prob=config.dropout,
        attention_probs_dropout_prob=config.attn_dropout,
    )


def bert_decoder_config(config: CaptionConfig, vocab_size: int, special: dict[str, int]) -> BertConfig:
    """The BERT decoder of ``config``: its width, depth, heads, MLP ratio and positions, causal, with cross-attention."""
    if config.mlp_type != "gelu" or config.gated:
        raise ValueError(f"the BERT decoder has GELU MLPs and no gates: caption_model.mlp_type must be 'gelu' and gated false, got {config.mlp_type!r}, {config.gated}")
    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=config.dim,
        num_hidden_layers=config.depth,
        num_attention_heads=config.heads,
        intermediate_size=round(config.dim * config.mlp_ratio),
        max_position_embeddings=config.max_length,
        hidden_dropout_prob=config.dropout,
        attention_probs_dropout_prob=config.attn_dropout,
        is_decoder=True,
        add_cross_attention=True,
        **special,
    )


class HFCaptionPeer(CaptionTokens, nn.Module):
    """``VisionEncoderDecoderModel`` (ViT + ``BertLMHeadModel`` with cross-attention) with vlfuse's tokenizer.

    Pixels in [0, 1] are normalised as ``ViTImageProcessor`` does (mean and std 0.5). A caption is
    ``BOS words EOS`` as for :class:`~vlfuse.captioning.CaptionModel`: the tokenizer's ``cls_token``
    is the decoder's start token and its ``sep_token`` the end token.

    Args:
        model: the transformers model.
        processor: vlfuse's processor (tokenizer with pad, cls = begin and sep = end tokens).
        max_length: the longest caption in tokens, begin and end tokens included.
    """

    def __init__(self, model: VisionEncoderDecoderModel, processor: VLFuseProcessor, max_length: int) -> None:
        super().__init__()
        self.model, self.processor, self.max_length = model, processor, max_length
        self.normalize = PixelNormalizer(IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD)  # images (B, 3, S, S) in [0, 1] -> the ViT's input

    @classmethod
    def from_caption_config(cls, config: CaptionConfig, captions: Iterable[str]) -> "HFCaptionPeer":
        """A new peer at the size of ``config``, its word-level tokenizer knowing every word of ``captions``
        (the tokenizer :meth:`CaptionModel.from_config <vlfuse.captioning.CaptionModel.from_config>` builds)."""
        return cls.from_processor(config, caption_processor(config, build_word_tokenizer(captions, config.max_length)))

    @classmethod
    def from_processor(cls, config: CaptionConfig, processor: VLFuseProcessor) -> "HFCaptionPeer":
        """A new peer at the size of ``config`` with the tokenizer of ``processor`` (from
        :func:`~vlfuse.captioning.model.caption_processor`)."""
        tokenizer = processor.tokenizer
        special = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.cls_token_id, "eos_token_id": tokenizer.sep_token_id}
        encoder = ViTModel(vit_config(config), add_pooling_layer=False)
        decoder = BertLMHeadModel(bert_decoder_config(config, len(tokenizer), special))
        model = VisionEncoderDecoderModel(encoder=encoder, decoder=decoder)
        model.config.decoder_start_token_id = tokenizer.cls_token_id
        model.config.pad_token_id = tokenizer.pad_token_id
        model.config.eos_token_id = tokenizer.sep_token_id
        model.generation_config.update(
            decoder_start_token_id=tokenizer.cls_token_id, pad_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.sep_token_id, bos_token_id=tokenizer.cls_token_id,
        )
        return cls(model, processor, config.max_length)

    def forward(self, pixel_values: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Teacher forcing: ``(B, L, vocab)`` scores of each next token of ``input_ids`` ``(B, L)``."""
        return self.model(pixel_values=self.normalize(pixel_values), decoder_input_ids=input_ids, use_cache=False).logits

    @torch.no_grad()
    def generate_ids(self, pixel_values: torch.Tensor, *, max_new_tokens: int | None = None, min_new_tokens: int = 0) -> torch.Tensor:
        """Greedy ``generate`` with the key/value cache: ``(B, 1 + T)`` ids, the start token first.

        Args:
            pixel_values: images ``(B, 3, S, S)`` in [0, 1].
            max_new_tokens: the most tokens after the start token (the end token included); default:
                all the decoder's positions.
            min_new_tokens: no end token before this many (to force a length when timing).
        """
        available = self.max_length - 1
        limit = available if max_new_tokens is None else max_new_tokens
        if not 1 <= limit <= available:
            raise ValueError(f"max_new_tokens must be in [1, {available}] (the decoder's positions after the start token), got {max_new_tokens}")
        return self.model.generate(
            pixel_values=self.normalize(pixel_values), do_sample=False, num_beams=1, use_cache=True,
            max_new_tokens=limit, min_new_tokens=min_new_tokens,
        )

    def caption(self, pixel_values: torch.Tensor, **options) -> list[str]:
        """Greedy captions of images ``(B, 3, S, S)`` in [0, 1] (``options``: those of :meth:`generate_ids`)."""
        return [self.detokenize(row[1:]) for row in self.generate_ids(pixel_values, **options).tolist()]
