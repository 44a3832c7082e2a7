"""Run a model over batches and accumulate the statistics of every fusion head, layer by layer.

Only running sums are kept (see :class:`~vlfuse.analysis.head_stats.HeadStatsAccumulator`), plus
the pooled-question attention of a few example pairs for drawing.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import islice
from typing import Iterable

import torch

from vlfuse.analysis.attention_maps import select_query
from vlfuse.analysis.head_roles import HeadRules
from vlfuse.analysis.head_stats import HeadStats, HeadStatsAccumulator, head_output_norms, object_cells
from vlfuse.model import VLFuseModel


@dataclass
class ExamplePair:
    """One image-question pair kept for drawing.

    Attributes:
        pixels: ``(3, S, S)`` the image as the model saw it, in [0, 1].
        question: the question.
        weights: ``{layer: (H, Lk)}`` attention of the pooled question (mean over its real tokens).
    """

    pixels: torch.Tensor
    question: str
    weights: dict[int, torch.Tensor]


@dataclass
class HeadCollection:
    """What :func:`collect_head_stats` gathered.

    Attributes:
        stats: one :class:`HeadStats` per fusion layer.
        head_ids: per layer, the original id of each head (pruned layers keep their numbering).
        grid: ``(rows, cols)`` of the patch grid.
        num_prefix_tokens: image tokens before the patch grid.
        examples: the first image-question pair of each of the first images.
        num_images: images seen.
        num_questions: questions seen.
    """

    stats: list[HeadStats]
    head_ids: list[list[int]]
    grid: tuple[int, int]
    num_prefix_tokens: int
    examples: list[ExamplePair]
    num_images: int
    num_questions: int


def _record_output_norms(model: VLFuseModel, norms: dict[int, torch.Tensor]) -> list:
    """Hook every cross-attention ``out_proj`` to store its heads' output norms in ``norms``: ``(N, H)`` over
    the real question tokens, in the order of ``text_mask`` (the fusion blocks run on packed tokens)."""

    def hook(layer: int, num_heads: int):
        def record(module, args) -> None:
            norms[layer] = head_output_norms(args[0], module.weight, num_heads)

        return record

    return [
        attention.out_proj.register_forward_pre_hook(hook(i, attention.num_heads))
        for i, attention in enumerate(model.attention_layers)
    ]


@torch.inference_mode()
def collect_head_stats(
    model: VLFuseModel,
    batches: Iterable[dict],
    *,
    max_batches: int | None = None,
    rules: HeadRules = HeadRules(),
    num_examples: int = 3,
) -> HeadCollection:
    """Statistics of every cross-attention head of ``model`` over ``batches``.

    Args:
        model: the model; it is put in eval mode and run on the device of its parameters.
        batches: batches from :func:`vlfuse.data.collate_grouped` (e.g. a DataLoader).
        max_batches: stop after this many batches (default: all).
        rules: its ``pixel_tolerance`` and ``cell_share`` define the object cells.
        num_examples: image-question pairs to keep for drawing (the first question of each of
            the first images).
    """
    model.eval()
    device = next(model.parameters()).device
    encoder = model.image_encoder
    grid, prefix = tuple(encoder.grid_size), model.attention_prefix_tokens
    attentions = model.attention_layers
    layers = list(range(len(attentions)))
    accumulators = [HeadStatsAccumulator(attentions[i].num_heads, grid, prefix) for i in layers]
    examples: list[ExamplePair] = []
    num_images = num_questions = 0
    norms: dict[int, torch.Tensor] = {}
    handles = _record_output_norms(model, norms)
    try:
        for batch in islice(batches, max_batches):
            inputs = model.processor.batch(batch, device)
            pixels, image_index = inputs.pixel_values, inputs.image_index  # (Bi, 3, S, S), (Bq,)
            out = model(**inputs, weights_from=layers)
            mask = out.text_mask  # (Bq, Lt)
            row_image = image_index[:, None].expand_as(mask)[mask]  # (N,) the image of each real token
            objects = object_cells(pixels, grid, tolerance=rules.pixel_tolerance, min_share=rules.cell_share)
            for layer in layers:
                weights = out.attentions[layer].transpose(1, 2)[mask]  # (Bq, Lt, H, Li) -> (N, H, Li)
                accumulators[layer].update(weights, objects[row_image], norms[layer])  # norms: (N, H)
            _keep_examples(examples, num_examples, pixels, batch["questions"], image_index, out)
            num_images += len(pixels)
            num_questions += len(image_index)
    finally:
        for handle in handles:
            handle.remove()
    if num_questions == 0:
        raise ValueError("the batches hold no questions: nothing to analyse")
    return HeadCollection(
        stats=[acc.result() for acc in accumulators],
        head_ids=model.fusion_head_ids,
        grid=grid,
        num_prefix_tokens=prefix,
        examples=examples,
        num_images=num_images,
        num_questions=num_questions,
    )


def _keep_examples(examples: list[ExamplePair], limit: int, pixels, questions, image_index, out) -> None:
    """Keep the first question of each image until ``limit`` examples are kept."""
    for image in range(len(pixels)):
        if len(examples) >= limit:
            return
        rows = (image_index == image).nonzero().flatten()
        if len(rows) == 0:
            continue
        row = int(rows[0])
        weights = {layer: select_query(w[row], out.text_mask[row]).float().cpu() for layer, w in out.attentions.items()}
        examples.append(ExamplePair(pixels[image].float().cpu(), questions[row], weights))
