"""Why a caption model wrote each word: the explanation methods of :mod:`vlfuse.analysis.explain`
for every generated word.

The caption is generated greedily, then read again with teacher forcing (one pass, the words
as the decoder wrote them), and each word ``t`` is explained by the logit ``y_t`` the decoder gave
it at the position that wrote it:

- ``attention``: the cross-attention of that position, per head, in one decoder block;
- ``gradcam``: ``A * relu(dy_t/dA)`` summed over the positions up to ``t`` (the causal
  self-attention lets earlier positions' reading reach word ``t``), per head; ``dy_t/dA`` is read
  through the block's values as for answers (:func:`~vlfuse.analysis.explain.weights_gradient`);
- ``input_gradient``: ``|dy_t/dpixels|`` pooled onto the patch grid;
- ``occlusion``: how much painting each patch over (the image's median colour, as for answers,
  :class:`~vlfuse.analysis.explain.Occlusion`) changes word ``t``'s log-odds where it was written,
  either way, with the caption kept as it was (teacher forcing over each painted image).

``rollout`` is refused: the decoder's causal self-attention mixes the words, and its weights are
not returned.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from vlfuse.analysis.explain import chosen_index, distribution, log_odds, occlusion_changes, weights_gradient
from vlfuse.captioning.generate import greedy
from vlfuse.captioning.model import CaptionModel
from vlfuse.model import ImageContext

CAPTION_METHODS = ("attention", "gradcam", "input_gradient", "occlusion")
"""The methods that explain a caption's words."""


@dataclass
class CaptionExplanation:
    """The maps of one method for each word of a generated caption.

    Attributes:
        method: one of :data:`CAPTION_METHODS`.
        caption: the caption's text.
        words: the generated tokens (the end token too, when written).
        token_maps: ``(heads, words, Li)`` each word's map per head over the image tokens (prefix
            tokens first, then the patch grid); one "head" for ``input_gradient`` and ``occlusion``.
        caption_map: ``(Li,)`` the whole caption's map: the mean over heads and words, summing to 1.
        grid: ``(rows, cols)`` of the patch grid.
        num_prefix_tokens: image tokens before the grid.
        heads: labels of the ``heads`` rows.
        layer: the decoder block read (``None`` for ``input_gradient`` and ``occlusion``).
    """

    method: str
    caption: str
    words: list[str]
    token_maps: np.ndarray
    caption_map: np.ndarray
    grid: tuple[int, int]
    num_prefix_tokens: int
    heads: list[str]
    layer: int | None


def explain_caption(model: CaptionModel, pixels: torch.Tensor, method: str = "gradcam", *, layer: int | None = None) -> CaptionExplanation:
    """Explain each word of the caption ``model`` writes for ``pixels`` ``(1, 3, S, S)`` with ``method``.

    Args:
        model: a caption model (in eval mode).
        pixels: one image as the model sees it (``model.processor.image(source)[None]``).
        method: one of :data:`CAPTION_METHODS`.
        layer: the decoder block of ``attention`` and ``gradcam`` (default the last).
    """
    if method not in CAPTION_METHODS:
        hint = " (the decoder's causal self-attention mixes the words)" if method == "rollout" else ""
        raise ValueError(f"method {method!r} does not explain captions{hint}: choose from {', '.join(CAPTION_METHODS)}")
    chosen = chosen_index(layer, model.num_layers, "the decoder has blocks")
    parameter = next(model.parameters())
    pixels = pixels.to(parameter.device, parameter.dtype)
    with torch.no_grad():
        [caption] = greedy(model, model.encode_images(pixels))
    ids = torch.tensor([caption.ids], device=parameter.device)  # (1, T)
    inputs = torch.cat([ids.new_full((1, 1), model.bos_id), ids[:, :-1]], dim=1)  # (1, T): what wrote each word
    maps = _MAPS[method](model, pixels, inputs, ids[0], chosen)  # (heads, T, Li)
    encoder = model.image_encoder
    per_block = method in ("attention", "gradcam")
    heads = [f"head {h}" for h in range(len(maps))] if per_block else [f"{method} (heads mixed)"]
    return CaptionExplanation(
        method=method,
        caption=caption.text,
        words=model.tokenizer.convert_ids_to_tokens(caption.ids),
        token_maps=maps.float().cpu().numpy(),
        caption_map=distribution(maps.mean((0, 1))).float().cpu().numpy(),
        grid=tuple(encoder.grid_size),
        num_prefix_tokens=encoder.num_prefix_tokens,
        heads=heads,
        layer=chosen if per_block else None,
    )


def _attention(model: CaptionModel, pixels, inputs, ids, layer: int) -> torch.Tensor:
    with torch.no_grad():
        return model.decode(inputs, model.encode_images(pixels), weights_from=[layer]).attentions[layer][0]  # (H, T, Li)


def _gradcam(model: CaptionModel, pixels, inputs, ids, layer: int) -> torch.Tensor:
    with torch.no_grad():
        features = model.encode_images(pixels).features
    value = features[layer].value.detach().requires_grad_()  # (1, H, Li, hd)
    features = [dataclasses.replace(kv, value=value) if i == layer else kv for i, kv in enumerate(features)]
    with torch.enable_grad():
        out = model.decode(inputs, ImageContext(features), weights_from=[layer])
        attention = out.attentions[layer][0].detach()  # (H, T, Li)
        word_maps = []
        for t, word in enumerate(ids.tolist()):
            [value_grad] = torch.autograd.grad(out.logits[0, t, word], value, retain_graph=True)
            gradient = weights_gradient(attention, value[0].detach(), value_grad[0])  # (H, T, Li)
            word_maps.append((attention * gradient.clamp_min(0))[:, : t + 1].sum(1))  # (H, Li): the positions up to t
    return torch.stack(word_maps, dim=1)  # (H, T, Li)


def _input_gradient(model: CaptionModel, pixels, inputs, ids, layer: int) -> torch.Tensor:
    pixels = pixels.detach().requires_grad_()
    with torch.enable_grad():
        logits = model.decode(inputs, model.encode_images(pixels)).logits[0]  # (T, vocab)
        word_maps = []
        for t, word in enumerate(ids.tolist()):
            [grad] = torch.autograd.grad(logits[t, word], pixels, retain_graph=True)
            saliency = grad[0].abs().sum(0)[None, None]  # (1, 1, S, S)
            patches = F.adaptive_avg_pool2d(saliency, tuple(model.image_encoder.grid_size)).flatten()  # (rows * cols,)
            word_maps.append(torch.cat([patches.new_zeros(model.image_encoder.num_prefix_tokens), patches]))
    return torch.stack(word_maps)[None]  # (1, T, Li)


def _occlusion(model: CaptionModel, pixels, inputs, ids, layer: int) -> torch.Tensor:
    def written_log_odds(images: torch.Tensor) -> torch.Tensor:  # (n, 3, S, S) -> (n, T): each word where it was written
        return log_odds(model.decode(inputs.expand(len(images), -1), model.encode_images(images)).logits, ids)

    with torch.no_grad():
        grid = tuple(model.image_encoder.grid_size)
        changes = occlusion_changes(pixels, grid, written_log_odds, written_log_odds(pixels))  # (patches, T)
    prefix = changes.new_zeros(len(ids), model.image_encoder.num_prefix_tokens)
    return torch.cat([prefix, changes.T], dim=1)[None]  # (1, T, Li)


_MAPS = {"attention": _attention, "gradcam": _gradcam, "input_gradient": _input_gradient, "occlusion": _occlusion}
