"""The attention-map files of ``vlfuse predict`` and ``vlfuse caption``, written by one writer.

For each item (an answered pair, a captioned image) :class:`AttentionMapWriter` draws PNGs, one
panel per head and the head average over the image as the model saw it
(:func:`vlfuse.analysis.attention_maps.draw_attention_map`), and writes the drawn weights
(``NAME.npz``) and a JSON sidecar (``NAME.json``). :class:`QuestionAttentionWriter` draws one query
of a question per fusion layer; :class:`CaptionAttentionWriter` every generated word per decoder layer.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from vlfuse import model_io
from vlfuse.analysis.attention_maps import draw_attention_map, select_query, split_prefix


class AttentionMapWriter:
    """Writes the attention maps of items over images of one patch grid.

    Args:
        directory: where to write (created).
        grid: ``(rows, cols)`` of the image encoder's patch grid.
        num_prefix_tokens: image tokens before the grid (CLS, registers).
    """

    def __init__(self, directory: str | Path, grid: Sequence[int], num_prefix_tokens: int) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.grid, self.num_prefix_tokens = tuple(grid), num_prefix_tokens

    @staticmethod
    def stem(name: str, fallback: str) -> str:
        """A file name for the item ``name`` (``line 3`` -> ``line_3``)."""
        return re.sub(r"\W+", "_", name).strip("_") or fallback

    def draw(
        self, png: str, pixels: torch.Tensor, weights: torch.Tensor, title: str, head_ids: Sequence[int] | None = None
    ) -> tuple[Path, Any]:
        """Draw ``weights`` ``(H, Li)`` over ``pixels`` ``(3, S, S)`` to ``directory/png``; returns the path and the panels."""
        image = pixels.permute(1, 2, 0).float().cpu().numpy()  # (S, S, 3)
        path = self.directory / png
        panels = draw_attention_map(image, weights, self.grid, self.num_prefix_tokens, path, head_ids=head_ids, title=title)
        return path, panels

    def finish(self, stem: str, pngs: list[Path], arrays: dict[str, np.ndarray], sidecar: dict) -> dict:
        """Write the weights and the sidecar of an item; returns every path written."""
        np.savez(self.directory / f"{stem}.npz", **arrays)
        sidecar = {**sidecar, "grid": list(self.grid), "num_prefix_tokens": self.num_prefix_tokens}
        model_io.write_json(self.directory / f"{stem}.json", sidecar, indent=1)
        return {"png": [str(p) for p in pngs], "weights": str(self.directory / f"{stem}.npz"),
                "json": str(self.directory / f"{stem}.json")}


class QuestionAttentionWriter(AttentionMapWriter):
    """The maps of answered pairs: for each fusion layer, one query (a question token or the pooled
    question) over the image, one panel per head.

    Args:
        model: the answering model (its tokenizer, patch grid and head ids).
        directory: where to write.
        layers: the fusion layers to draw.
        token: the question token to draw, or ``None`` for the pooled question.
    """

    def __init__(self, model, directory: str | Path, layers: list[int], token: int | None) -> None:
        super().__init__(directory, model.image_encoder.grid_size, model.attention_prefix_tokens)
        self.layers, self.token = layers, token
        self.tokenizer = model.tokenizer
        self.head_ids = {layer: model.fusion_head_ids[layer] for layer in layers}

    def write(self, pair, pixels: torch.Tensor, weights: dict[int, torch.Tensor], text_mask: torch.Tensor,
              input_ids: torch.Tensor, result: dict) -> dict:
        """Write the files of one pair; ``weights`` ``{layer: (H, Lt, Li)}``. Returns the paths written."""
        stem = self.stem(pair.name, "pair")
        if self.token is None:
            query = "pooled question"
        else:
            query = f"token {self.token} {self.tokenizer.convert_ids_to_tokens(int(input_ids[self.token]))!r}"
        arrays, layers, pngs = {}, {}, []
        for layer in self.layers:
            drawn = select_query(weights[layer], text_mask, self.token).float().cpu()  # (H, Li)
            title = f"{pair.question!r} -> {result['answer']} ({result['score']:.2f}) | layer {layer}, {query}"
            png, panels = self.draw(f"{stem}_layer{layer}.png", pixels, drawn, title, head_ids=self.head_ids[layer])
            _, prefix_mass = split_prefix(drawn, self.grid, self.num_prefix_tokens)
            arrays[f"layer_{layer}"] = drawn.numpy()
            layers[str(layer)] = {"png": png.name, "panels": panels, "heads": self.head_ids[layer],
                                  "prefix_mass": prefix_mass.tolist()}
            pngs.append(png)
        is_path = isinstance(pair.image, (str, os.PathLike))
        sidecar = {
            "image": os.fspath(pair.image) if is_path else f"<{type(pair.image).__name__}>",
            "question": pair.question,
            "answer": result["answer"],
            "score": result["score"],
            "query": query,
            "weights": f"{stem}.npz: layer_L (heads, prefix + patch tokens), each row sums to 1",
            "layers": layers,
        }
        return self.finish(stem, pngs, arrays, sidecar)


class CaptionAttentionWriter(AttentionMapWriter):
    """The maps of a caption: a PNG per decoder layer and generated word (one panel per head and
    their mean), the drawn weights (``layer_L``: ``(H, words, Li)``) and a JSON sidecar.

    Args:
        model: the caption model (its tokenizer and patch grid).
        directory: where to write.
        layers: the decoder layers to draw.
    """

    def __init__(self, model, directory: str | Path, layers: Sequence[int]) -> None:
        encoder = model.image_encoder
        super().__init__(directory, encoder.grid_size, encoder.num_prefix_tokens)
        self.layers, self.tokenizer = list(layers), model.tokenizer

    def write(self, name: str, pixels: torch.Tensor, caption) -> dict:
        """Write the files of one image's caption (a :class:`~vlfuse.captioning.Caption`); returns the paths written."""
        stem = self.stem(name, "image")
        words = self.tokenizer.convert_ids_to_tokens(caption.ids)
        pngs = []
        for layer in self.layers:
            weights = caption.attentions[layer].float()  # (H, words, Li)
            for t, word in enumerate(words):
                title = f"{caption.text!r} | layer {layer}, word {t} {word!r}"
                pngs.append(self.draw(f"{stem}_layer{layer}_word{t:02d}.png", pixels, weights[:, t], title)[0])
        arrays = {f"layer_{layer}": caption.attentions[layer].numpy() for layer in self.layers}
        sidecar = {
            "caption": caption.text,
            "words": words,
            "weights": f"{stem}.npz: layer_L (heads, words, prefix + patch tokens), each row sums to 1",
            "png": [p.name for p in pngs],
        }
        return self.finish(stem, pngs, arrays, sidecar)
