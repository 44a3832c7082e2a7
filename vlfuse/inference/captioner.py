"""Describe images in words with a saved caption model: :class:`Captioner`.

Images go through the model's processor, the transform training used, in batches; a bad image is
reported in its place (or raised). Greedy decoding or beam search (:mod:`vlfuse.captioning.generate`);
attention maps draw, for each generated word, each head's cross-attention over the patch grid.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence

import torch

from vlfuse.captioning.generate import Caption, beam_search, greedy
from vlfuse.captioning.model import CaptionModel, is_caption_model
from vlfuse.data import ImageLoadError, ImageSource
from vlfuse.inference.attention_maps import CaptionAttentionWriter
from vlfuse.inference.predictor import ERROR_POLICIES, non_finite
from vlfuse.inference.runner import ModelRunner
from vlfuse.runtime import DEFAULT_DEVICE, DEFAULT_THREADS, using_threads


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


class Captioner(ModelRunner):
    """Writes captions for images with a :class:`~vlfuse.captioning.CaptionModel`.

    Args:
        model: the model (put in eval mode and moved to ``device``).
        device: where to run, e.g. ``"cpu"`` or ``"cuda"``.
        batch_size: images per forward pass.
        threads: torch's CPU threads during :meth:`caption` (restored after it); ``None`` leaves
            torch's setting (see :class:`~vlfuse.inference.runner.ModelRunner`).

    Example:
        >>> captioner = Captioner.from_pretrained("runs/shapes_captions/model")
        >>> captioner.caption(["scene.png"], beam_size=3)
    """

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        device: str | torch.device = DEFAULT_DEVICE,
        batch_size: int = 64,
        threads: int | None = DEFAULT_THREADS,
    ) -> "Captioner":
        """Load a model saved by :meth:`CaptionModel.save_pretrained` (its errors name what is wrong)."""
        if not is_caption_model(directory) and Path(directory, "answers.json").is_file():
            raise ValueError(f"{directory} is a model that answers questions (vlfuse.Predictor, or vlfuse predict)")
        model = CaptionModel.from_pretrained(directory, map_location=device)
        return cls(model, device=device, batch_size=batch_size, threads=threads)

    def caption(
        self,
        images: Sequence[ImageSource],
        *,
        beam_size: int = 1,
        length_penalty: float = 1.0,
        max_length: int | None = None,
        errors: str = "raise",
        names: Sequence[str] | None = None,
        attention_maps: str | Path | None = None,
        attention_layers: Sequence[int] | None = None,
    ) -> list[dict]:
        """Describe each image in words.

        Args:
            images: file paths, PIL images or RGB uint8 arrays.
            beam_size: hypotheses kept per image by beam search; 1 (default) is greedy decoding.
            length_penalty: beam search ranks ``log-probability / length ** length_penalty``.
            max_length: the most tokens per caption (its end token included); default: the model's limit.
            errors: ``"raise"``: an unreadable image, or a caption whose log-probability is not
                finite (a model with broken weights), raises a ``ValueError`` naming it; ``"report"``:
                it gets ``{"error": message}`` and every other image is captioned.
            names: a name per image, for errors and attention-map files (default ``row 0``, ...).
            attention_maps: a directory: for each image, a PNG per layer and generated word with one
                panel per head and the head average, the weights (``NAME.npz``) and ``NAME.json``.
            attention_layers: decoder layers to draw (default: all).

        Returns:
            One dict per image, in order: ``caption`` (str) and ``score`` (its log-probability,
            length-normalised by beam search), ``attention_maps`` (the files) when asked; or
            ``error`` for a bad image with ``errors="report"``.
        """
        batches = self.caption_batches(
            images, beam_size=beam_size, length_penalty=length_penalty, max_length=max_length, errors=errors,
            names=names, attention_maps=attention_maps, attention_layers=attention_layers,
        )
        return [result for batch in batches for result in batch]

    def caption_batches(
        self,
        images: Sequence[ImageSource],
        *,
        beam_size: int = 1,
        length_penalty: float = 1.0,
        max_length: int | None = None,
        errors: str = "raise",
        names: Sequence[str] | None = None,
        attention_maps: str | Path | None = None,
        attention_layers: Sequence[int] | None = None,
    ) -> Iterator[list[dict]]:
        """:meth:`caption`, yielding its results batch by batch: each item is a list of the next
        results in input order (together, :meth:`caption`'s list), so that a caller can write them
        before the rest is done. The arguments are checked when this is called; the images are read
        and captioned as the items are taken."""
        if errors not in ERROR_POLICIES:
            raise ValueError(f"errors must be one of {ERROR_POLICIES}, got {errors!r}")
        options = CaptionOptions(beam_size, length_penalty, max_length)
        depth = self.model.num_layers
        layers = list(range(depth)) if attention_layers is None else sorted(set(attention_layers))
        bad = [layer for layer in layers if not 0 <= layer < depth]
        if bad:
            raise ValueError(f"attention layers {bad} out of range: the model has decoder layers 0..{depth - 1}")
        names = [f"row {i}" for i in range(len(images))] if names is None else list(names)
        writer = None if attention_maps is None else CaptionAttentionWriter(self.model, attention_maps, layers)
        return self._batches(images, names, options, errors == "raise", writer)

    def _batches(
        self, images, names, options: CaptionOptions, raise_errors: bool, writer: CaptionAttentionWriter | None
    ) -> Iterator[list[dict]]:
        """:meth:`caption_batches` on checked arguments: each batch of ``batch_size`` readable images,
        with the unreadable ones read before them, runs with the captioner's threads and in inference
        mode (both left between batches)."""
        rows = iter(range(len(images)))
        while True:
            with using_threads(self.threads), torch.inference_mode():
                batch = self._next_batch(rows, images, names, options, raise_errors, writer)
            if not batch:
                return
            yield batch

    def _next_batch(self, rows: Iterator[int], images, names, options: CaptionOptions, raise_errors: bool,
                    writer: CaptionAttentionWriter | None) -> list[dict]:
        """Read images from ``rows`` on until ``batch_size`` of them are readable (or none is left) and
        caption those: the results of the rows read, in order (empty at the end)."""
        results: dict[int, dict] = {}
        pixels: dict[int, torch.Tensor] = {}
        for row in rows:
            try:
                pixels[row] = self.model.processor.image(images[row])
            except ImageLoadError as err:
                if raise_errors:
                    raise ImageLoadError(f"{names[row]}: {err}") from err
                results[row] = {"error": str(err)}
            if len(pixels) == self.batch_size:
                break
        if pixels:
            batch = torch.stack(list(pixels.values())).to(self.device)  # (B, 3, S, S)
            drawn = writer.layers if writer is not None else ()
            for row, image, caption in zip(pixels, batch, options.generate(self.model, batch, drawn)):
                results[row] = self._result(names[row], image, caption, raise_errors, writer)
        return [results[row] for row in sorted(results)]

    @staticmethod
    def _result(name: str, image: torch.Tensor, caption: Caption, raise_errors: bool,
                writer: CaptionAttentionWriter | None) -> dict:
        """The result of one captioned image: its caption and score, and its attention maps when drawn;
        or the error of a score that is not finite (raised with ``raise_errors``)."""
        error = non_finite([caption.score], "log-probability")
        if error is not None:
            if raise_errors:
                raise ValueError(f"{name}: {error}")
            return {"error": error}
        result = {"caption": caption.text, "score": caption.score}
        if writer is not None:
            result["attention_maps"] = writer.write(name, image, caption)
        return result
