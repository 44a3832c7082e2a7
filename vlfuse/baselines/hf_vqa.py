"""Hugging Face transformers' VQA models as peers of the fusion model, built from their configs, from scratch.

- :class:`BlipVQA`: ``BlipForQuestionAnswering`` (a ViT; a BERT question encoder whose layers
  cross-attend to the patches; a BERT answer decoder that cross-attends to the question), trained on
  the tokenised answer and scored by greedy ``generate``.
- :class:`ViltVQA`: ``ViltForQuestionAnswering`` (one transformer over the question's tokens and the
  image's patches together, a classifier over the answers), trained on the cross-entropy.

Both take vlfuse's batches: :func:`vlfuse.data.collate_grouped` images (Bi, 3, S, S) in [0, 1],
each once, ``image_index`` (Bq,) the image of each question, and word ids from
:func:`vlfuse.encoders.tokenizer.build_word_tokenizer` (the tokenizer of vlfuse's processor). Each
normalises pixels as its transformers image processor does. ``loss(..., labels)`` is the training
loss, ``answer(...)`` the index of each question's answer (-1: an answer outside the list).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import BlipConfig, BlipForQuestionAnswering, ViltConfig, ViltForQuestionAnswering
from transformers.utils.constants import IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from vlfuse.data import IGNORE_INDEX

NO_ANSWER = -1
""":meth:`BlipVQA.answer`'s index for a generated text that is none of the answers."""


class PixelNormalizer(nn.Module):
    """``(pixels - mean) / std`` per channel, the statistics of a transformers image processor."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        self.register_buffer("mean", torch.tensor(mean).view(1, 3, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std).view(1, 3, 1, 1), persistent=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return (pixels - self.mean) / self.std


def check_heads(width: int, heads: int) -> None:
    """A ValueError naming ``width`` and ``heads`` unless the heads split the width evenly."""
    if width % heads:
        raise ValueError(f"width ({width}) must be a multiple of heads ({heads})")


def blip_vqa_config(
    vocab_size: int, *, image_size: int, patch_size: int, width: int = 128, heads: int = 16, vision_layers: int = 1,
    text_layers: int = 1, mlp_ratio: int = 4, max_length: int = 32, pad_id: int, bos_id: int, sep_id: int,
) -> BlipConfig:
    """A from-scratch ``BlipConfig``: one width and head count for the ViT, the question encoder and the
    answer decoder (``text_layers`` each); the decoder starts at ``bos_id`` and stops at ``sep_id``."""
    check_heads(width, heads)
    if image_size % patch_size:
        raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
    vision = dict(
        hidden_size=width, intermediate_size=mlp_ratio * width, num_hidden_layers=vision_layers, num_attention_heads=heads,
        image_size=image_size, patch_size=patch_size,
        initializer_range=0.02,  # the class's 1e-10 starts the position embeddings at zero; 0.02 as the text's
    )
    text = dict(
        vocab_size=vocab_size, hidden_size=width, encoder_hidden_size=width, intermediate_size=mlp_ratio * width,
        num_hidden_layers=text_layers, num_attention_heads=heads, max_position_embeddings=max_length,
        pad_token_id=pad_id, bos_token_id=bos_id, sep_token_id=sep_id, eos_token_id=sep_id,
    )
    return BlipConfig(text_config=text, vision_config=vision)


def vilt_config(
    vocab_size: int, num_answers: int, *, image_size: int, patch_size: int, width: int = 128, heads: int = 16,
    layers: int = 3, mlp_ratio: int = 4, max_length: int = 32, pad_id: int,
) -> ViltConfig:
    """A from-scratch ``ViltConfig`` classifying over ``num_answers`` answers, every patch kept."""
    check_heads(width, heads)
    if image_size % patch_size:
        raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
    return ViltConfig(
        vocab_size=vocab_size, hidden_size=width, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=mlp_ratio * width, image_size=image_size, patch_size=patch_size,
        max_position_embeddings=max_length, pad_token_id=pad_id, num_labels=num_answers, max_image_length=-1,
    )


class BlipVQA(nn.Module):
    """``BlipForQuestionAnswering`` on vlfuse's batches, the answer generated as text.

    Training runs the ViT once per image and gives each question its image's patches (as vlfuse's
    model does), then the class's question encoder and answer decoder with the answer's tokens as
    ``labels``; this equals the class's ``forward`` on one image copy per question. Scoring is the
    class's greedy ``generate``; the text it writes is looked up in the answer list.

    Args:
        config: e.g. :func:`blip_vqa_config`.
        answer_ids: (A, La) each answer's tokens, ``[CLS] words [SEP]`` right-padded with the config's pad id.
        answer_mask: (A, La) 1 for an answer's tokens, 0 for padding.
    """

    def __init__(self, config: BlipConfig, answer_ids: torch.Tensor, answer_mask: torch.Tensor) -> None:
        super().__init__()
        if answer_ids.shape != answer_mask.shape or answer_ids.ndim != 2:
            raise ValueError(f"answer_ids {tuple(answer_ids.shape)} and answer_mask {tuple(answer_mask.shape)} must be one (A, La) shape")
        self.hf = BlipForQuestionAnswering(config)
        self.normalize = PixelNormalizer(OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)
        self.register_buffer("answer_ids", answer_ids, persistent=False)
        self.register_buffer("answer_mask", answer_mask, persistent=False)

    def loss(self, pixel_values, input_ids, attention_mask, image_index, labels) -> torch.Tensor:
        """The answer decoder's mean token cross-entropy; questions labelled ``IGNORE_INDEX`` are left out."""
        known = labels != IGNORE_INDEX
        input_ids, attention_mask, image_index, labels = input_ids[known], attention_mask[known], image_index[known], labels[known]
        patches = self.hf.vision_model(pixel_values=self.normalize(pixel_values)).last_hidden_state  # (Bi, 1 + P, D)
        patches = patches[image_index]  # (Bq, 1 + P, D): each question's image
        question = self.hf.text_encoder(
            input_ids=input_ids, attention_mask=attention_mask, encoder_hidden_states=patches,
            encoder_attention_mask=torch.ones(patches.shape[:-1], dtype=torch.long, device=patches.device),
        ).last_hidden_state  # (Bq, Lt, D)
        targets = self.answer_ids[labels]  # (Bq, La)
        mask = self.answer_mask[labels]
        return self.hf.text_decoder(
            input_ids=targets, attention_mask=mask, encoder_hidden_states=question, encoder_attention_mask=attention_mask,
            labels=targets.masked_fill(mask == 0, IGNORE_INDEX), reduction="mean",
        ).loss

    @torch.no_grad()
    def generate(self, pixel_values, input_ids, attention_mask, image_index) -> torch.Tensor:
        """The class's greedy ``generate``: (Bq, <= La) tokens, starting with the decoder's start token."""
        pixels = self.normalize(pixel_values)[image_index]  # (Bq, 3, S, S)
        return self.hf.generate(
            input_ids=input_ids, pixel_values=pixels, attention_mask=attention_mask,
            max_new_tokens=self.answer_ids.shape[1] - 1, do_sample=False, num_beams=1,
        )

    @torch.no_grad()
    def answer(self, pixel_values, input_ids, attention_mask, image_index) -> torch.Tensor:
        """(Bq,) the index of the answer whose tokens the greedy text is, or :data:`NO_ANSWER`."""
        generated = self.generate(pixel_values, input_ids, attention_mask, image_index)  # (Bq, Lg)
        length = self.answer_ids.shape[1]
        pad = self.hf.config.text_config.pad_token_id
        generated = nn.functional.pad(generated[:, :length], (0, length - min(length, generated.shape[1])), value=pad)
        generated = generated.masked_fill(after_first(generated, self.hf.config.text_config.sep_token_id), pad)
        answers = self.answer_ids.masked_fill(self.answer_mask == 0, pad)  # (A, La)
        same = (generated[:, None, :] == answers[None]).all(dim=-1)  # (Bq, A)
        return torch.where(same.any(dim=-1), same.float().argmax(dim=-1), NO_ANSWER)


def after_first(tokens: torch.Tensor, stop: int) -> torch.Tensor:
    """(B, L) True at the positions after each row's first ``stop`` token (what generation writes after it)."""
    seen = (tokens == stop).long().cumsum(dim=-1)
    return (seen - (tokens == stop).long()) > 0


class ViltVQA(nn.Module):
    """``ViltForQuestionAnswering`` on vlfuse's batches: a classifier over the answer list.

    ViLT reads text and patches in one sequence, so each question gets its own copy of its image.
    """

    def __init__(self, config: ViltConfig) -> None:
        super().__init__()
        self.hf = ViltForQuestionAnswering(config)
        self.normalize = PixelNormalizer(IMAGENET_STANDARD_MEAN, IMAGENET_STANDARD_STD)

    def forward(self, pixel_values, input_ids, attention_mask, image_index) -> torch.Tensor:
        """(Bq, A) answer logits."""
        pixels = self.normalize(pixel_values)[image_index]  # (Bq, 3, S, S)
        return self.hf(input_ids=input_ids, attention_mask=attention_mask, pixel_values=pixels).logits

    def loss(self, pixel_values, input_ids, attention_mask, image_index, labels) -> torch.Tensor:
        """The cross-entropy over the answers, as vlfuse's; questions labelled ``IGNORE_INDEX`` are left out.

        Not the class's own loss (binary cross-entropy per answer, made for VQA's soft scores over
        thousands of answers): on easy-VQA's one answer in 13 it spent its first steps pushing every
        logit down and answered one answer to every question after 60 batches (docs/results.md#peers-side-by-side).
        """
        return nn.functional.cross_entropy(self(pixel_values, input_ids, attention_mask, image_index), labels,
                                           ignore_index=IGNORE_INDEX)

    @torch.no_grad()
    def answer(self, pixel_values, input_ids, attention_mask, image_index) -> torch.Tensor:
        """(Bq,) the index of the top answer."""
        return self(pixel_values, input_ids, attention_mask, image_index).argmax(dim=-1)
