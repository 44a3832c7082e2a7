"""Answer questions about images with a saved model: :class:`Predictor` and ``vlfuse predict``.

Images go through :func:`vlfuse.data.preprocess_image`, the function training uses. Questions about
the same image (the same path, or the same PIL object) share one encoding of the image: its keys
and values are projected once and every question attends to them through ``image_index``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Sequence

import numpy as np
import torch
from PIL import Image
from tqdm import tqdm

from vlfuse.analysis.attention_maps import draw_attention_map, select_query, split_prefix
from vlfuse.data import ImageLoadError, ImageSource, preprocess_image
from vlfuse.cli import SUBCOMMANDS
from vlfuse.captioning.inference import CaptionOptions, caption_images
from vlfuse.captioning.model import CaptionModel, is_caption_model
from vlfuse.model import ImageContext, VLFuseModel
from vlfuse.runtime import (
    DEFAULT_DEVICE,
    DEFAULT_THREADS,
    add_device_argument,
    add_threads_argument,
    check_threads,
    using_threads,
)

ERROR_POLICIES = ("raise", "report")
PROGRESS_MIN_PAIRS = 256
"""``vlfuse predict`` shows a progress bar on inputs longer than this, when stderr is a terminal."""


class PredictWarning(UserWarning):
    """A question the model reads differently from how it was written: truncated, or with unknown words."""


@dataclass
class _Pair:
    """One image-question pair on its way through :meth:`Predictor.predict`."""

    image: ImageSource
    question: str
    name: str
    key: Hashable = None
    num_tokens: int = 0
    error: str | None = None
    warnings: list[str] = field(default_factory=list)


@dataclass
class _EncodedImage:
    """An image as the model saw it, ``pixels`` (3, S, S), and its :class:`~vlfuse.model.ImageContext` (batch of one)."""

    pixels: torch.Tensor
    context: ImageContext


class Predictor:
    """Answers questions about images with a :class:`~vlfuse.model.VLFuseModel`.

    Args:
        model: the model (put in eval mode and moved to ``device``).
        device: where to run, e.g. ``"cpu"`` or ``"cuda"``.
        batch_size: image-question pairs per forward pass.
        cache_images: encode each distinct image once per :meth:`predict` call, however many
            questions ask about it. ``False`` treats every pair on its own (it loads and encodes
            its image itself): the behaviour without the cache, for benchmarks.
        threads: torch's CPU threads during :meth:`predict` (restored after it); ``None`` leaves
            torch's setting. The default, 1, stays fast when other processes share the cores
            (:mod:`vlfuse.runtime`).

    Example:
        >>> predictor = Predictor.from_pretrained("runs/easy_vqa/model")
        >>> predictor.predict(["a.png", "a.png"], ["what shape is in the image?", "what color is the shape?"], top_k=3)
    """

    def __init__(
        self,
        model: VLFuseModel,
        *,
        device: str | torch.device = DEFAULT_DEVICE,
        batch_size: int = 64,
        cache_images: bool = True,
        threads: int | None = DEFAULT_THREADS,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        check_threads(threads, "threads")
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.batch_size = batch_size
        self.cache_images = cache_images
        self.threads = threads

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        device: str | torch.device = DEFAULT_DEVICE,
        batch_size: int = 64,
        cache_images: bool = True,
        threads: int | None = DEFAULT_THREADS,
    ) -> "Predictor":
        """Load a model saved by :meth:`VLFuseModel.save_pretrained` or :meth:`CaptionModel.save_pretrained`
        (its errors name what is wrong)."""
        loader = CaptionModel if is_caption_model(directory) else VLFuseModel
        model = loader.from_pretrained(directory, map_location=device)
        return cls(model, device=device, batch_size=batch_size, cache_images=cache_images, threads=threads)

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
        """Describe each image in words, with a caption model (:class:`~vlfuse.captioning.CaptionModel`).

        Args:
            images: file paths, PIL images or RGB uint8 arrays.
            beam_size: hypotheses kept per image by beam search; 1 (default) is greedy decoding.
            length_penalty: beam search ranks ``log-probability / length ** length_penalty``.
            max_length: the most tokens per caption (its end token included); default: the model's limit.
            errors: ``"raise"``: an unreadable image raises a ``ValueError`` naming it; ``"report"``:
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
        if not isinstance(self.model, CaptionModel):
            raise ValueError("this model answers questions (use predict); caption needs a caption model (vlfuse.captioning)")
        if errors not in ERROR_POLICIES:
            raise ValueError(f"errors must be one of {ERROR_POLICIES}, got {errors!r}")
        options = CaptionOptions(beam_size, length_penalty, max_length)
        layers = list(range(self.model.num_layers)) if attention_layers is None else sorted(set(attention_layers))
        bad = [layer for layer in layers if not 0 <= layer < self.model.num_layers]
        if bad:
            raise ValueError(f"attention layers {bad} out of range: the model has decoder layers 0..{self.model.num_layers - 1}")
        names = [f"row {i}" for i in range(len(images))] if names is None else list(names)
        with using_threads(self.threads):
            return caption_images(
                self.model, images, names, options, batch_size=self.batch_size, raise_errors=errors == "raise",
                attention_maps=attention_maps, attention_layers=layers if attention_maps is not None else (),
            )

    @property
    def answers(self) -> list[str]:
        """The answers the model chooses from."""
        return self.model.answers

    def predict(
        self,
        images: Sequence[ImageSource],
        questions: Sequence[str],
        top_k: int = 1,
        *,
        errors: str = "raise",
        attention_maps: str | Path | None = None,
        attention_layers: Sequence[int] | None = None,
        attention_token: int | None = None,
        names: Sequence[str] | None = None,
        progress: bool = False,
    ) -> list[dict]:
        """Answer ``questions[i]`` about ``images[i]`` for every i.

        Args:
            images: one per question: file paths, PIL images or RGB uint8 arrays; repeat the same
                path or object for several questions about one image.
            questions: the questions.
            top_k: also return the ``top_k`` best answers (when above 1).
            errors: ``"raise"``: a bad pair (unreadable image, empty question) raises a
                ``ValueError`` naming it, before any answer for question errors. ``"report"``: a
                bad pair gets ``{"error": message}`` and every other pair is answered.
            attention_maps: a directory: for each pair, write a PNG per layer with one panel per
                head and the head average, the drawn weights (``NAME.npz``, ``layer_L``: ``(H, Li)``
                over all image tokens, prefix tokens first) and a JSON sidecar (``NAME.json``).
            attention_layers: fusion layers to draw (default: all); only they leave the fast path.
            attention_token: the question token to draw (a position in the tokenized question,
                special tokens included), or ``None`` for the pooled question.
            names: a name per pair, for warnings, exceptions and attention-map files
                (default ``row 0``, ``row 1``, ...).
            progress: show a progress bar on stderr.

        Returns:
            One dict per pair, in input order: ``answer`` and ``score`` (its softmax probability),
            ``top_k`` (a list of ``{answer, score}``, best first) when ``top_k > 1``, ``warnings``
            when the question was truncated or has unknown words (each also issued as a
            :class:`PredictWarning`), ``attention_maps`` (the files written) when asked;
            or ``error`` (and no answer) for a bad pair with ``errors="report"``.
        """
        layers = self._check_arguments(
            images, questions, names, top_k, errors, attention_maps, attention_layers, attention_token
        )
        names = [f"row {i}" for i in range(len(questions))] if names is None else list(names)
        with using_threads(self.threads):
            return self._predict(images, questions, names, top_k, errors, attention_maps, layers, attention_token, progress)

    def _predict(
        self, images, questions, names, top_k, errors, attention_maps, layers, attention_token, progress
    ) -> list[dict]:
        """:meth:`predict` on checked arguments."""
        pairs = self._prepare(images, questions, names, attention_token)
        self._raise_or_warn(pairs, raise_errors=errors == "raise")
        writer = None
        if attention_maps is not None:
            writer = _AttentionWriter(self.model, attention_maps, layers, attention_token)
        results: dict[int, dict] = {}
        batches, last_batch = self._plan(pairs)
        encoded: dict[Hashable, _EncodedImage] = {}
        failed: dict[Hashable, str] = {}
        bar = tqdm(total=sum(map(len, batches)), unit="pair", disable=not progress, file=sys.stderr)
        with bar, torch.inference_mode():
            for b, rows in enumerate(batches):
                self._encode_new_images([pairs[r] for r in rows], encoded, failed, raise_errors=errors == "raise")
                results.update(self._answer(rows, pairs, encoded, top_k, writer))
                for key in [k for k in encoded if last_batch[k] == b]:
                    del encoded[key]  # no later batch asks about this image
                bar.update(len(rows))
        return [self._finish(pair, results.get(i)) for i, pair in enumerate(pairs)]

    # ------------------------------------------------------------------------ checking the input
    def _check_arguments(
        self, images, questions, names, top_k, errors, attention_maps, attention_layers, attention_token
    ) -> list[int]:
        """Validate the call (not the pairs); return the fusion layers to draw."""
        if isinstance(self.model, CaptionModel):
            raise ValueError("this is a caption model: it describes images (use caption, or vlfuse caption)")
        if isinstance(questions, str) or isinstance(images, (str, os.PathLike, Image.Image)):
            raise ValueError("images and questions must be sequences (one image per question), not a single item")
        if names is None and len(images) != len(questions):
            raise ValueError(f"need one image per question: got {len(images)} images and {len(questions)} questions")
        if names is not None and not len(images) == len(questions) == len(names):
            raise ValueError(
                f"need one image and one name per question: got {len(images)} images, {len(questions)} questions "
                f"and {len(names)} names"
            )
        if not 1 <= top_k <= len(self.answers):
            raise ValueError(f"top_k must be in [1, {len(self.answers)}] (the number of answers), got {top_k}")
        if errors not in ERROR_POLICIES:
            raise ValueError(f"errors must be one of {ERROR_POLICIES}, got {errors!r}")
        depth = self.model.num_fusion_layers
        if attention_maps is None:
            if attention_layers is not None or attention_token is not None:
                raise ValueError("attention_layers and attention_token need attention_maps (the directory to write to)")
            return []
        self.model.require_fusion_heads("draw attention maps of")
        layers = list(range(depth)) if attention_layers is None else sorted(set(attention_layers))
        bad = [layer for layer in layers if not 0 <= layer < depth]
        if bad:
            raise ValueError(f"attention layers {bad} out of range: the model has fusion layers 0..{depth - 1}")
        return layers

    def _prepare(self, images, questions, names, attention_token: int | None) -> list[_Pair]:
        """Pair up the input and record, per pair, what is wrong with it and what the reader should know."""
        pairs = [_Pair(image, question, name) for image, question, name in zip(images, questions, names)]
        for row, pair in enumerate(pairs):
            if not isinstance(pair.question, str):
                pair.error = f"question must be a string, got {type(pair.question).__name__}"
            elif not pair.question.strip():
                pair.error = "empty question"
            else:
                try:
                    pair.key = self._image_key(pair.image, row)
                except ValueError as err:
                    pair.error = str(err)
        self._read_questions([p for p in pairs if p.error is None], attention_token)
        return pairs

    def _image_key(self, image: ImageSource, row: int) -> Hashable:
        """What identifies an image: its absolute path or the object itself; with the cache off, the row."""
        if isinstance(image, (str, os.PathLike)):
            key = os.path.abspath(os.fspath(image))
        elif isinstance(image, (Image.Image, np.ndarray)):
            key = id(image)  # the caller's list keeps the object alive, so ids are not reused
        else:
            raise ValueError(f"image must be a file path, a PIL image or an RGB array, got {type(image).__name__}")
        return key if self.cache_images else row

    def _read_questions(self, pairs: list[_Pair], attention_token: int | None) -> None:
        """Tokenize untruncated to find questions that get truncated or contain unknown words."""
        if not pairs:
            return
        tokenizer, limit = self.model.tokenizer, self.model.config.text.max_length
        encoded = tokenizer(
            [p.question for p in pairs], truncation=False, return_offsets_mapping=True, verbose=False
        )
        for pair, ids, offsets in zip(pairs, encoded["input_ids"], encoded["offset_mapping"]):
            pair.num_tokens = min(len(ids), limit)
            unknown = [pair.question[s:e] for token, (s, e) in zip(ids, offsets) if token == tokenizer.unk_token_id]
            if unknown:
                words = ", ".join(repr(w) for w in dict.fromkeys(unknown))
                pair.warnings.append(f"unknown words, read as {tokenizer.unk_token}: {words}")
            if len(ids) > limit:
                pair.warnings.append(f"question has {len(ids)} tokens; the model reads the first {limit}")
            if attention_token is not None and not 0 <= attention_token < pair.num_tokens:
                pair.error = (
                    f"attention_token {attention_token} is not a position of this question ({pair.num_tokens} tokens)"
                )

    @staticmethod
    def _raise_or_warn(pairs: list[_Pair], raise_errors: bool) -> None:
        """Raise for the first bad pair (``errors="raise"``); issue every pair's warnings."""
        bad = next((p for p in pairs if p.error is not None), None)
        if raise_errors and bad is not None:
            raise ValueError(f"{bad.name}: {bad.error}")
        for pair in pairs:
            for message in pair.warnings:
                warnings.warn(f"{pair.name}: {message}", PredictWarning, stacklevel=3)

    # ----------------------------------------------------------------------------- the work
    def _plan(self, pairs: list[_Pair]) -> tuple[list[list[int]], dict[Hashable, int]]:
        """Rows to answer, grouped by image and cut into batches; and the last batch each image is needed in."""
        first_row: dict[Hashable, int] = {}
        for row, pair in enumerate(pairs):
            if pair.error is None:
                first_row.setdefault(pair.key, row)
        order = sorted((r for r, p in enumerate(pairs) if p.error is None), key=lambda r: first_row[pairs[r].key])
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        last_batch = {pairs[r].key: b for b, rows in enumerate(batches) for r in rows}
        return batches, last_batch

    def _encode_new_images(
        self,
        pairs: list[_Pair],
        encoded: dict[Hashable, _EncodedImage],
        failed: dict[Hashable, str],
        raise_errors: bool,
    ) -> None:
        """Preprocess and encode, in one call, the images of ``pairs`` not encoded yet; mark unreadable ones."""
        new: dict[Hashable, torch.Tensor] = {}
        for pair in pairs:
            if pair.key in encoded or pair.key in new:
                continue
            if pair.key not in failed:
                try:
                    new[pair.key] = preprocess_image(pair.image, self.model.config.image.image_size)
                    continue
                except ImageLoadError as err:
                    if raise_errors:
                        raise ImageLoadError(f"{pair.name}: {err}") from err
                    failed[pair.key] = str(err)
            pair.error = failed[pair.key]
        if not new:
            return
        pixels = torch.stack(list(new.values())).to(self.device)  # (Bi, 3, S, S)
        context = self.model.encode_images(pixels)  # per layer: (Bi, H, Li, hd)
        for i, key in enumerate(new):
            encoded[key] = _EncodedImage(pixels[i], context.select(slice(i, i + 1)))  # views, batch of one

    def _answer(
        self,
        rows: list[int],
        pairs: list[_Pair],
        encoded: dict[Hashable, _EncodedImage],
        top_k: int,
        writer: _AttentionWriter | None,
    ) -> dict[int, dict]:
        """One forward pass over the readable pairs of a batch: ``{row: result}``."""
        rows = [r for r in rows if pairs[r].error is None]
        if not rows:
            return {}
        keys = list(dict.fromkeys(pairs[r].key for r in rows))
        slot = {key: i for i, key in enumerate(keys)}
        image_index = torch.tensor([slot[pairs[r].key] for r in rows], device=self.device)  # (Bq,)
        context = ImageContext.cat([encoded[key].context for key in keys])
        tokens = self.model.tokenize([pairs[r].question for r in rows])
        input_ids, attention_mask = tokens["input_ids"].to(self.device), tokens["attention_mask"].to(self.device)
        out = self.model(
            None,
            input_ids,
            attention_mask,
            image_index=image_index,
            image_context=context,
            weights_from=writer.layers if writer else (),
        )
        scores, best = out.logits.float().softmax(-1).topk(top_k, dim=-1)  # each (Bq, top_k)
        results = {}
        for j, row in enumerate(rows):
            result = self._result(scores[j].tolist(), best[j].tolist(), top_k)
            if writer is not None:
                weights = {layer: w[j] for layer, w in out.attentions.items()}  # (H, Lt, Li) each
                pixels = encoded[pairs[row].key].pixels
                mask, ids = out.text_mask[j], input_ids[j]
                result["attention_maps"] = writer.write(pairs[row], pixels, weights, mask, ids, result)
            results[row] = result
        return results

    def _result(self, scores: list[float], best: list[int], top_k: int) -> dict:
        result = {"answer": self.answers[best[0]], "score": scores[0]}
        if top_k > 1:
            result["top_k"] = [{"answer": self.answers[i], "score": s} for i, s in zip(best, scores)]
        return result

    @staticmethod
    def _finish(pair: _Pair, result: dict | None) -> dict:
        """The result of a pair, or its error; with its warnings."""
        result = {"error": pair.error} if pair.error is not None else dict(result)
        if pair.warnings:
            result["warnings"] = list(pair.warnings)
        return result


class _AttentionWriter:
    """Writes the attention maps of answered pairs: a PNG per layer, the drawn weights and a JSON sidecar."""

    def __init__(self, model: VLFuseModel, directory: str | Path, layers: list[int], token: int | None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.layers, self.token = layers, token
        self.tokenizer = model.tokenizer
        self.grid = tuple(model.image_encoder.grid_size)
        self.num_prefix_tokens = model.image_encoder.num_prefix_tokens
        self.head_ids = {layer: model.fusion_head_ids[layer] for layer in layers}

    def write(
        self,
        pair: _Pair,
        pixels: torch.Tensor,
        weights: dict[int, torch.Tensor],
        text_mask: torch.Tensor,
        input_ids: torch.Tensor,
        result: dict,
    ) -> dict:
        """Write the files of one pair; ``weights`` ``{layer: (H, Lt, Li)}``. Returns the paths written."""
        stem = re.sub(r"\W+", "_", pair.name).strip("_") or "pair"
        if self.token is None:
            query = "pooled question"
        else:
            query = f"token {self.token} {self.tokenizer.convert_ids_to_tokens(int(input_ids[self.token]))!r}"
        image = pixels.permute(1, 2, 0).float().cpu().numpy()  # (S, S, 3)
        arrays, layers, pngs = {}, {}, []
        for layer in self.layers:
            drawn = select_query(weights[layer], text_mask, self.token).float().cpu()  # (H, Li)
            png = self.directory / f"{stem}_layer{layer}.png"
            title = f"{pair.question!r} -> {result['answer']} ({result['score']:.2f}) | layer {layer}, {query}"
            panels = draw_attention_map(
                image, drawn, self.grid, self.num_prefix_tokens, png, head_ids=self.head_ids[layer], title=title
            )
            _, prefix_mass = split_prefix(drawn, self.grid, self.num_prefix_tokens)
            arrays[f"layer_{layer}"] = drawn.numpy()
            layers[str(layer)] = {
                "png": png.name,
                "panels": panels,
                "heads": self.head_ids[layer],
                "prefix_mass": prefix_mass.tolist(),
            }
            pngs.append(str(png))
        np.savez(self.directory / f"{stem}.npz", **arrays)
        is_path = isinstance(pair.image, (str, os.PathLike))
        sidecar = {
            "image": os.fspath(pair.image) if is_path else f"<{type(pair.image).__name__}>",
            "question": pair.question,
            "answer": result["answer"],
            "score": result["score"],
            "query": query,
            "grid": list(self.grid),
            "num_prefix_tokens": self.num_prefix_tokens,
            "weights": f"{stem}.npz: layer_L (heads, prefix + patch tokens), each row sums to 1",
            "layers": layers,
        }
        sidecar_path = self.directory / f"{stem}.json"
        sidecar_path.write_text(json.dumps(sidecar, indent=1) + "\n")
        return {"png": pngs, "weights": str(self.directory / f"{stem}.npz"), "json": str(sidecar_path)}


# ---------------------------------------------------------------------------------- vlfuse predict
@dataclass
class _InputRow:
    """One non-blank line of a ``--input`` JSONL file."""

    line: int
    fields: dict
    image: Path | None = None
    error: str | None = None


def read_pairs(path: Path, keys: Sequence[str] = ("image", "question")) -> list[_InputRow]:
    """Parse a JSONL file of objects with ``keys`` (``image`` among them); a bad line becomes a row with an error.

    Image paths are relative to the file's directory, unless absolute. Blank lines are skipped.
    """
    with open(path, encoding="utf-8", errors="replace") as lines:
        return [_parse_line(n, text, path.parent, keys) for n, text in enumerate(lines, 1) if text.strip()]


def _parse_line(number: int, text: str, base: Path, keys: Sequence[str]) -> _InputRow:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        return _InputRow(number, {}, error=f"malformed JSON: {err}")
    if not isinstance(record, dict):
        return _InputRow(number, {}, error=f"expected a JSON object with {' and '.join(repr(k) for k in keys)}")
    fields = {key: record[key] for key in keys if key in record}
    missing = [key for key in keys if key not in record]
    if missing:
        return _InputRow(number, fields, error=f"missing {' and '.join(repr(k) for k in missing)}")
    if not isinstance(record["image"], str) or not record["image"]:
        return _InputRow(number, fields, error="'image' must be a non-empty path string")
    return _InputRow(number, fields, image=base / record["image"])


def build_parser() -> argparse.ArgumentParser:
    """The arguments of ``vlfuse predict``."""
    parser = argparse.ArgumentParser(
        prog="vlfuse predict",
        description=SUBCOMMANDS["predict"].description,
        epilog="examples:\n"
        "  vlfuse predict --model runs/easy_vqa/model --image shape.png --question 'what shape is it?'\n"
        "  vlfuse predict --model runs/easy_vqa/model --input pairs.jsonl --output answers.jsonl --top-k 3\n"
        "  vlfuse predict --model runs/easy_vqa/model --input pairs.jsonl > answers.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", required=True, help="model directory (written by save_pretrained or the fit export)")
    one = parser.add_argument_group("one pair")
    one.add_argument("--image", help="image file")
    one.add_argument("--question", help="question about the image")
    many = parser.add_argument_group("many pairs")
    many.add_argument("--input", type=Path, help="JSONL file, one {\"image\": PATH, \"question\": TEXT} per line; "
                      "relative paths are relative to this file")
    many.add_argument("--output", type=Path,
                      help="JSONL file to write, one line per input line, in order (default: standard output)")
    parser.add_argument("--top-k", type=int, default=1, metavar="K", help="also give the K best answers")
    parser.add_argument("--batch-size", type=int, default=64, help="pairs per forward pass (default 64)")
    add_device_argument(parser)
    add_threads_argument(parser)
    maps = parser.add_argument_group("attention maps")
    maps.add_argument("--attention-maps", type=Path, metavar="OUT_DIR", help="write attention maps of every pair here")
    maps.add_argument(
        "--attention-layers", type=int, nargs="+", metavar="L", help="fusion layers to draw (default all)"
    )
    maps.add_argument("--attention-token", type=int, metavar="T",
                      help="draw the question token at position T (default: the pooled question)")
    return parser


def main(argv: list[str]) -> int:
    """``vlfuse predict``: one pair (``--image``, ``--question``) or a JSONL file (``--input``, ``--output``)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    one_pair = _mode(parser, args) == "one pair"
    predictor = Predictor.from_pretrained(args.model, device=args.device, batch_size=args.batch_size, threads=args.threads)
    options = {
        "top_k": args.top_k,
        "errors": "report",
        "attention_maps": args.attention_maps,
        "attention_layers": args.attention_layers,
        "attention_token": args.attention_token,
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PredictWarning)  # printed below, with the line they belong to
        if one_pair:
            return _predict_one(predictor, args.image, args.question, options)
        return _predict_file(predictor, args.input, args.output, options)


def _mode(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """``"one pair"`` or ``"file"``; a usage error (exit 2) when the arguments mix or miss parts of both."""
    one, many = [args.image, args.question], [args.input, args.output]
    if all(v is not None for v in one) and all(v is None for v in many):
        return "one pair"
    if args.input is not None and all(v is None for v in one):
        return "file"
    parser.error("give either --image and --question, or --input (and optionally --output)")


def _predict_one(predictor: Predictor, image: str, question: str, options: dict) -> int:
    [result] = predictor.predict([image], [question], **options)
    for message in result.get("warnings", []):
        print(f"vlfuse: warning: {message}", file=sys.stderr)
    if "error" in result:
        raise ValueError(result["error"])
    print(f"answer: {result['answer']} (probability {result['score']:.4f})")
    if "top_k" in result:
        width = max(len(entry["answer"]) for entry in result["top_k"])
        print(f"top {len(result['top_k'])}:")
        for entry in result["top_k"]:
            print(f"  {entry['answer']:<{width}}  {entry['score']:.4f}")
    if "attention_maps" in result:
        print(f"attention maps: {' '.join(result['attention_maps']['png'])}")
    return 0


def _predict_file(predictor: Predictor, source: Path, target: Path | None, options: dict) -> int:
    """Answer every line of ``source``; write JSONL to ``target``, or to standard output when ``None``."""
    rows = read_pairs(source)
    readable = [row for row in rows if row.error is None]
    results = iter(
        predictor.predict(
            [row.image for row in readable],
            [row.fields["question"] for row in readable],
            names=[f"line {row.line}" for row in readable],
            progress=len(readable) > PROGRESS_MIN_PAIRS and sys.stderr.isatty(),
            **options,
        )
    )
    return write_rows(rows, results, target, "vlfuse predict", "answered", options["attention_maps"])


def write_rows(
    rows: list[_InputRow], results, target: Path | None, command: str, done: str, attention_maps: Path | None
) -> int:
    """Write one JSONL line per input row, in order, to ``target`` (or standard output): the row's fields
    and its result from ``results`` (an iterator over the readable rows' results), or its error in
    place; report on stderr. Returns the exit status: 1 when a row failed, else 0.

    Args:
        command: the command named in the messages, e.g. ``"vlfuse predict"``.
        done: what was done to every row, e.g. ``"answered"``.
        attention_maps: the directory attention maps were written to, if any.
    """
    failed = []
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
    where = "standard output" if target is None else str(target)
    with open(target, "w", encoding="utf-8") if target is not None else nullcontext(sys.stdout) as out:
        for row in rows:
            result = {"error": row.error} if row.error is not None else next(results)
            for message in result.get("warnings", []):
                print(f"vlfuse: warning: line {row.line}: {message}", file=sys.stderr)
            if "error" in result:
                result["error"] = f"line {row.line}: {result['error']}"
                failed.append(row.line)
            out.write(json.dumps({"line": row.line, **row.fields, **result}) + "\n")
    if attention_maps is not None:
        print(f"{command}: wrote attention maps to {attention_maps}", file=sys.stderr)
    if failed:
        shown = ", ".join(map(str, failed[:20])) + (", ..." if len(failed) > 20 else "")
        summary = f"{len(failed)} of {len(rows)} rows failed (lines {shown}); see 'error' in {where}"
        print(f"{command}: {summary}", file=sys.stderr)
        return 1
    print(f"{command}: {done} every row ({len(rows)}); wrote {where}", file=sys.stderr)
    return 0
