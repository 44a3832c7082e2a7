"""Head pruning: which heads go, the pruned copy, and what it saves (parameters, CPU latency).

Head scores are ``(L, H0)`` tensors over the original head ids of each fusion layer (higher =
more important), with NaN for heads already removed; :mod:`vlfuse.analysis.head_scores` makes them.
"""

from __future__ import annotations

import copy
import math
import statistics
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import torch
from torch import nn

from vlfuse.analysis.timing import paired_ratio, time_interleaved
from vlfuse.model import VLFuseModel


def heads_to_prune(
    scores: torch.Tensor, fraction: float | None = None, threshold: float | None = None
) -> dict[int, list[int]]:
    """The lowest-scored heads, ranked globally over all layers: ``{layer: sorted original ids}``.

    Exactly one rule applies:
    - ``fraction``: the ``fraction * N`` (rounded half up) lowest-scored of the N heads still present;
    - ``threshold``: every head whose score is at most ``threshold``.

    A layer never loses its last head: when the ranking reaches it, it is skipped and the next
    lowest head of another layer is taken instead (so a fraction is still met exactly), and under
    a threshold the layer keeps its best head. Ties are broken by (layer, head). Heads with a NaN
    score (already removed) are neither counted nor returned. Layers losing no head are left out.

    Raises:
        ValueError: when neither or both rules are given, ``fraction`` is outside [0, 1), or the
            fraction would need every head of some layer.
    """
    if (fraction is None) == (threshold is None):
        raise ValueError("give exactly one of fraction or threshold")
    if scores.dim() != 2:
        raise ValueError(f"scores must be (layers, heads), got shape {tuple(scores.shape)}")
    present = ~torch.isnan(scores)
    left = present.sum(1).tolist()  # heads still present in each layer
    ranked = sorted((float(scores[l, h]), l, h) for l, h in present.nonzero().tolist())
    if fraction is not None:
        if not 0.0 <= fraction < 1.0:
            raise ValueError(f"fraction must be in [0, 1), got {fraction}")
        total = len(ranked)
        wanted = math.floor(fraction * total + 0.5)
        most = total - sum(1 for n in left if n > 0)
        if wanted > most:
            raise ValueError(
                f"fraction {fraction} means pruning {wanted} of {total} heads, but at most {most} can go "
                "(every layer keeps one head)"
            )
    else:
        within = scores <= threshold  # compared in the scores' dtype, as they were computed
        ranked = [entry for entry in ranked if within[entry[1], entry[2]]]
        wanted = len(ranked)
    pruned: dict[int, list[int]] = {}
    for _, layer, head in ranked:
        if wanted == 0:
            break
        if left[layer] > 1:
            left[layer] -= 1
            wanted -= 1
            pruned.setdefault(layer, []).append(head)
    return {layer: sorted(ids) for layer, ids in sorted(pruned.items())}


def prune_model(model: VLFuseModel, heads: Mapping[int, Iterable[int]]) -> VLFuseModel:
    """A deep copy of ``model`` with ``heads`` (``{layer: original ids}``) removed for real."""
    pruned = copy.deepcopy(model)
    pruned.prune_heads(dict(heads))
    return pruned


def count_parameters(module: nn.Module) -> int:
    """Number of parameter elements of ``module`` (trainable or not)."""
    return sum(p.numel() for p in module.parameters())


def heads_per_layer(model: VLFuseModel) -> list[int]:
    """Cross-attention heads left in each fusion layer."""
    return [len(ids) for ids in model.fusion_head_ids]


@dataclass
class Latency:
    """Seconds of each timed forward pass (inference mode), in the order they ran.

    Attributes:
        fusion_times: the fuser: what it reads of the image tokens (e.g. every layer's keys/values),
            then the fuser itself, from encoder outputs computed beforehand.
        model_times: the whole model, from pixels and token ids to answer logits.
    """

    fusion_times: list[float]
    model_times: list[float]

    @property
    def fusion(self) -> float:
        """Median seconds of the fuser."""
        return statistics.median(self.fusion_times)

    @property
    def model(self) -> float:
        """Median seconds of the whole model."""
        return statistics.median(self.model_times)


def speedup(before: Latency, after: Latency) -> tuple[float, float]:
    """``(fuser, whole model)`` speed-ups of ``after`` over ``before``.

    Medians of the per-repetition ratios: repetition i of both ran side by side, so a burst of
    load from other processes cancels out, which a ratio of medians does not guarantee.
    """
    return paired_ratio(before.fusion_times, after.fusion_times), paired_ratio(before.model_times, after.model_times)


def take_questions(batches: Sequence[dict], n: int) -> dict:
    """One :func:`vlfuse.data.collate_grouped` batch of the first ``n`` questions of ``batches``
    (all of them when there are fewer), with only their images."""
    pixels, questions, labels, index, offset = [], [], [], [], 0
    for batch in batches:
        pixels.append(batch["pixel_values"])
        questions += batch["questions"]
        labels.append(batch["labels"])
        index.append(batch["image_index"] + offset)
        offset += len(batch["pixel_values"])
    if not questions:
        raise ValueError("no questions to take: the batches are empty")
    index = torch.cat(index)[:n]
    images, image_index = torch.unique(index, return_inverse=True)  # the images in use, renumbered from 0
    return {
        "pixel_values": torch.cat(pixels)[images],
        "questions": questions[:n],
        "labels": torch.cat(labels)[:n],
        "image_index": image_index,
    }


def measure_latency(
    models: Mapping[str, VLFuseModel], batch: dict, repeats: int = 20, warmup: int = 3
) -> dict[str, Latency]:
    """Forward-pass latency of several models on one batch, measured side by side.

    Every repetition times each model's fuser and then its whole forward pass, the models
    in a rotating order, so that the noise of a shared machine falls on all alike (compare them
    with :func:`speedup`). Runs on each model's own device and dtype, in eval mode, without
    gradients.

    Args:
        models: ``{name: model}``, e.g. ``{"before": model, "after": pruned}``.
        batch: a :func:`vlfuse.data.collate_grouped` batch, e.g. from :func:`take_questions`.
        repeats: timed repetitions; ``warmup`` more run first, untimed.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    runs = {(name, part): run for name, model in models.items()
            for part, run in zip(("fusion", "model"), _forward_runs(model, batch))}
    times = time_interleaved(runs, repeats, warmup).samples
    return {name: Latency(times[name, "fusion"], times[name, "model"]) for name in models}


def _forward_runs(model: VLFuseModel, batch: dict):
    """Two closures timing (the fuser, the whole model) on ``batch``; encoder outputs precomputed."""
    model.eval()
    parameter = next(model.parameters())
    inputs = model.processor.batch(batch, parameter.device, parameter.dtype)
    image_index, text_mask = inputs.image_index, inputs.attention_mask.bool()
    with torch.inference_mode():
        image_tokens = model.embed_images(inputs.pixel_values)  # (Bi, Li, fusion_dim)
        text = model.encode_questions(inputs.input_ids, inputs.attention_mask)  # (Bq, Lt, fusion_dim)

    @torch.inference_mode()
    def fusion() -> None:
        model.fuse(text, text_mask, model.image_context(image_tokens), image_index)

    @torch.inference_mode()
    def whole() -> None:
        model(**inputs)

    return fusion, whole
