"""Captions for images with a saved caption model: what :meth:`vlfuse.Predictor.caption` runs.

Images go through :func:`vlfuse.data.preprocess_image`, as in training, in batches; a bad image is
reported in its place (or raised). Attention maps draw, for each generated word, each head's
cross-attention over the patch grid with the drawing code of ``vlfuse predict``
(:func:`vlfuse.analysis.attention_maps.draw_attention_map`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from vlfuse.analysis.attention_maps import draw_attention_map
from vlfuse.captioning.generate import Caption, beam_search, greedy
from vlfuse.captioning.model import CaptionModel
from vlfuse.data import ImageLoadError, ImageSource, preprocess_image


@dataclass
class CaptionOptions:
    """How to write captions.

    Attributes:
        beam_size: hypotheses kept per image; 1 is greedy decoding.
        length_penalty: exponent of the length normalisation of beam search (see :func:`beam_search`).
        max_length: the most tokens after the begin token; ``None``: every position of the decoder.
    """

    beam_size: int = 1
    length_penalty: float = 1.0
    max_length: int | None = None

    def __post_init__(self) -> None:
        if self.beam_size < 1:
            raise ValueError(f"beam_size must be at least 1, got {self.beam_size}")

    def generate(self, model: CaptionModel, pixels: torch.Tensor, attention_layers: Sequence[int] = ()) -> list[Caption]:
        """Captions of ``pixels`` ``(B, 3, S, S)``."""
        context = model.encode_images(pixels)
        if self.beam_size == 1:
            return greedy(model, context, max_length=self.max_length, attention_layers=attention_layers)
        return beam_search(
            model, context, beam_size=self.beam_size, length_penalty=self.length_penalty, max_length=self.max_length,
            attention_layers=attention_layers,
        )


def caption_images(
    model: CaptionModel,
    images: Sequence[ImageSource],
    names: Sequence[str],
    options: CaptionOptions,
    *,
    batch_size: int,
    raise_errors: bool,
    attention_maps: str | Path | None = None,
    attention_layers: Sequence[int] = (),
) -> list[dict]:
    """One dict per image, in order: ``caption`` and ``score``, ``attention_maps`` (files) when asked,
    or ``error`` for an unreadable image when not ``raise_errors``."""
    device = next(model.parameters()).device
    writer = None if attention_maps is None else CaptionAttentionWriter(model, attention_maps, attention_layers)
    results: list[dict] = [{} for _ in images]
    pixels: dict[int, torch.Tensor] = {}
    for row, image in enumerate(images):
        try:
            pixels[row] = preprocess_image(image, model.config.image.image_size)
        except ImageLoadError as err:
            if raise_errors:
                raise ImageLoadError(f"{names[row]}: {err}") from err
            results[row] = {"error": str(err)}
    readable = list(pixels)
    with torch.inference_mode():
        for start in range(0, len(readable), batch_size):
            rows = readable[start : start + batch_size]
            batch = torch.stack([pixels[r] for r in rows]).to(device)  # (B, 3, S, S)
            for row, image, caption in zip(rows, batch, options.generate(model, batch, attention_layers)):
                results[row] = {"caption": caption.text, "score": caption.score}
                if writer is not None:
                    results[row]["attention_maps"] = writer.write(names[row], image, caption)
    return results


class CaptionAttentionWriter:
    """Writes, for a caption, a PNG per layer and generated word (one panel per head and their mean),
    the drawn weights (``NAME.npz``, ``layer_L``: ``(H, words, Li)``) and a JSON sidecar (``NAME.json``)."""

    def __init__(self, model: CaptionModel, directory: str | Path, layers: Sequence[int]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.layers, self.tokenizer = list(layers), model.tokenizer
        self.grid = tuple(model.image_encoder.grid_size)
        self.num_prefix_tokens = model.image_encoder.num_prefix_tokens

    def write(self, name: str, pixels: torch.Tensor, caption: Caption) -> dict:
        """Write the files of one image's caption; returns the paths written."""
        stem = re.sub(r"\W+", "_", name).strip("_") or "image"
        image = pixels.permute(1, 2, 0).float().cpu().numpy()  # (S, S, 3)
        words = self.tokenizer.convert_ids_to_tokens(caption.ids)
        pngs = []
        for layer in self.layers:
            weights = caption.attentions[layer].float()  # (H, words, Li)
            for t, word in enumerate(words):
                png = self.directory / f"{stem}_layer{layer}_word{t:02d}.png"
                title = f"{caption.text!r} | layer {layer}, word {t} {word!r}"
                draw_attention_map(image, weights[:, t], self.grid, self.num_prefix_tokens, png, title=title)
                pngs.append(str(png))
        np.savez(self.directory / f"{stem}.npz", **{f"layer_{l}": caption.attentions[l].numpy() for l in self.layers})
        sidecar = {
            "caption": caption.text,
            "words": words,
            "grid": list(self.grid),
            "num_prefix_tokens": self.num_prefix_tokens,
            "weights": f"{stem}.npz: layer_L (heads, words, prefix + patch tokens), each row sums to 1",
            "png": [Path(p).name for p in pngs],
        }
        sidecar_path = self.directory / f"{stem}.json"
        sidecar_path.write_text(json.dumps(sidecar, indent=1) + "\n")
        return {"png": pngs, "weights": str(self.directory / f"{stem}.npz"), "json": str(sidecar_path)}
