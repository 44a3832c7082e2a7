"""Answer questions about images with a saved model: :class:`Predictor`.

Images go through the model's processor (:class:`~vlfuse.processor.VLFuseProcessor`), the transform
training used. Questions about the same image (the same path, or the same PIL object) share one
encoding of the image: its keys and values are projected once and every question attends to them
through ``image_index``.
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Iterator, Sequence

import torch
from PIL import Image
from tqdm import tqdm

from vlfuse.captioning.model import is_caption_model
from vlfuse.data import ImageLoadError, ImageSource
from vlfuse.inference.attention_maps import QuestionAttentionWriter
from vlfuse.inference.onnx_model import OnnxAnswerModel, is_onnx_export
from vlfuse.model import ImageContext, VLFuseModel
from vlfuse.processor import image_key
from vlfuse.inference.runner import ModelRunner
from vlfuse.runtime import DEFAULT_DEVICE, DEFAULT_THREADS, using_threads

ERROR_POLICIES = ("raise", "report")
PROGRESS_MIN_PAIRS = 256
"""``vlfuse predict`` shows a progress bar on inputs longer than this, when stderr is a terminal."""
LOW_CONFIDENCE_UNKNOWN = 0.5
"""An answer to a question with at least this share of its words unknown to the tokenizer is marked
``low_confidence``: the model read little of what was asked."""


class PredictWarning(UserWarning):
    """A question the model reads differently from how it was written: truncated, or with unknown words."""


def non_finite(values: Sequence[float], what: str) -> str | None:
    """The error for model outputs ``values`` of which one is NaN or infinite (``what`` they are, e.g.
    ``"scores"``), or ``None`` when all are finite: such outputs come from broken weights, not answers."""
    bad = next((v for v in values if not math.isfinite(v)), None)
    if bad is None:
        return None
    return f"the model gave non-finite {what} ({bad}); its weights may be damaged or overflow"


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
    unknown_words: list[str] = field(default_factory=list)
    low_confidence: bool = False


@dataclass
class _EncodedImage:
    """An image as the model saw it, ``pixels`` (3, S, S), and its :class:`~vlfuse.model.ImageContext` (batch of one)."""

    pixels: torch.Tensor
    context: ImageContext


class Predictor(ModelRunner):
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
        super().__init__(model, device=device, batch_size=batch_size, threads=threads)
        self.cache_images = cache_images

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        device: str | torch.device = DEFAULT_DEVICE,
        batch_size: int = 64,
        cache_images: bool = True,
        threads: int | None = DEFAULT_THREADS,
    ) -> "Predictor":
        """Load a model saved by :meth:`VLFuseModel.save_pretrained`, or an ONNX export of one
        (``vlfuse export``, run by :class:`~vlfuse.inference.onnx_model.OnnxAnswerModel` with
        ``threads`` onnxruntime threads); the errors name what is wrong."""
        if is_caption_model(directory):
            raise ValueError(f"{directory} is a caption model: it describes images (vlfuse.Captioner, or vlfuse caption)")
        if is_onnx_export(directory):
            model = OnnxAnswerModel.from_pretrained(directory, device=device, threads=threads)
        else:
            model = VLFuseModel.from_pretrained(directory, map_location=device)
        return cls(model, device=device, batch_size=batch_size, cache_images=cache_images, threads=threads)

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
            images: one per question: file paths, PIL images, numpy arrays or torch tensors (the
                forms of :func:`vlfuse.data.transforms.array_to_image`); repeat the same path or
                object for several questions about one image.
            questions: the questions.
            top_k: also return the ``top_k`` best answers (when above 1).
            errors: ``"raise"``: a bad pair (unreadable image, empty question, scores that are not
                finite) raises a ``ValueError`` naming it, before any answer for question errors.
                ``"report"``: a bad pair gets ``{"error": message}`` and every other pair is answered.
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
            :class:`PredictWarning`), ``unknown_words`` (the words read as the unknown token, once
            each, in order) when there are any, ``low_confidence: True`` on an answer when at least
            :data:`LOW_CONFIDENCE_UNKNOWN` of the question's words are unknown, ``attention_maps``
            (the files written) when asked;
            or ``error`` (and no answer) for a bad pair with ``errors="report"``, among them a pair
            whose scores are NaN or infinite (a model with broken weights).
        """
        batches = self.predict_batches(
            images, questions, top_k, errors=errors, attention_maps=attention_maps, attention_layers=attention_layers,
            attention_token=attention_token, names=names, progress=progress,
        )
        return [result for batch in batches for result in batch]

    def predict_batches(
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
    ) -> Iterator[list[dict]]:
        """:meth:`predict`, yielding its results as the batches are answered: each item is a list of
        the next results in input order (together, :meth:`predict`'s list), so that a caller can write
        them before the rest is done. The arguments are checked, the questions read and their
        warnings issued when this is called; the model runs as the items are taken.

        Questions about one image are answered in one batch, so a batch may finish rows after ones
        that are not answered yet: those results wait for the rows before them.
        """
        layers = self._check_arguments(
            images, questions, names, top_k, errors, attention_maps, attention_layers, attention_token
        )
        names = [f"row {i}" for i in range(len(questions))] if names is None else list(names)
        with using_threads(self.threads):
            pairs = self._prepare(images, questions, names, attention_token)
        self._raise_or_warn(pairs, raise_errors=errors == "raise")
        writer = None
        if attention_maps is not None:
            writer = QuestionAttentionWriter(self.model, attention_maps, layers, attention_token)
        return self._batches(pairs, top_k, errors == "raise", writer, progress)

    def _batches(
        self, pairs: list[_Pair], top_k: int, raise_errors: bool, writer: QuestionAttentionWriter | None, progress: bool
    ) -> Iterator[list[dict]]:
        """:meth:`predict_batches` on prepared pairs. Each batch runs with the predictor's threads and
        in inference mode, both left between batches: the caller's code between items runs as its own."""
        results: dict[int, dict] = {}
        batches, last_batch = self._plan(pairs)
        pending = {row for rows in batches for row in rows}
        encoded: dict[Hashable, _EncodedImage] = {}
        failed: dict[Hashable, str] = {}
        start = 0
        bar = tqdm(total=len(pending), unit="pair", disable=not progress, file=sys.stderr)
        with bar:
            for b, rows in enumerate(batches):
                with using_threads(self.threads), torch.inference_mode():
                    self._encode_new_images([pairs[r] for r in rows], encoded, failed, raise_errors)
                    results.update(self._answer(rows, pairs, encoded, top_k, writer, raise_errors))
                for key in [k for k in encoded if last_batch[k] == b]:
                    del encoded[key]  # no later batch asks about this image
                bar.update(len(rows))
                pending.difference_update(rows)
                stop = next((r for r in range(start, len(pairs)) if r in pending), len(pairs))
                if stop > start:
                    yield [self._finish(pairs[r], results.pop(r, None)) for r in range(start, stop)]
                    start = stop
        if start < len(pairs):  # no batch at all: every pair has an error
            yield [self._finish(pair, None) for pair in pairs[start:]]

    # ------------------------------------------------------------------------ checking the input
    def _check_arguments(
        self, images, questions, names, top_k, errors, attention_maps, attention_layers, attention_token
    ) -> list[int]:
        """Validate the call (not the pairs); return the fusion layers to draw."""
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
        """What identifies an image (:func:`vlfuse.processor.image_key`); with the cache off, the row."""
        key = image_key(image)
        return key if self.cache_images else row

    def _read_questions(self, pairs: list[_Pair], attention_token: int | None) -> None:
        """Tokenize untruncated to find questions that get truncated or contain unknown words."""
        if not pairs:
            return
        tokenizer, limit = self.model.tokenizer, self.model.processor.max_length
        encoded = tokenizer(
            [p.question for p in pairs], truncation=False, return_offsets_mapping=True, verbose=False
        )
        for i, (pair, ids, offsets) in enumerate(zip(pairs, encoded["input_ids"], encoded["offset_mapping"])):
            pair.num_tokens = min(len(ids), limit)
            unknown = [pair.question[s:e] for token, (s, e) in zip(ids, offsets) if token == tokenizer.unk_token_id]
            pair.unknown_words = list(dict.fromkeys(unknown))
            if unknown:
                words = ", ".join(repr(w) for w in pair.unknown_words)
                pair.warnings.append(f"unknown words, read as {tokenizer.unk_token}: {words}")
            missing, total = count_unknown_words(pair.question, ids, offsets, encoded.word_ids(i), tokenizer.unk_token_id)
            pair.low_confidence = total > 0 and missing >= LOW_CONFIDENCE_UNKNOWN * total
            if pair.low_confidence:
                pair.warnings.append(f"{missing} of the question's {total} words are unknown: a low-confidence answer")
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
                    new[pair.key] = self.model.processor.image(pair.image)
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
        writer: QuestionAttentionWriter | None,
        raise_errors: bool,
    ) -> dict[int, dict]:
        """One forward pass over the readable pairs of a batch: ``{row: result}``; a pair whose
        scores are not finite gets an error instead (or raises one)."""
        rows = [r for r in rows if pairs[r].error is None]
        if not rows:
            return {}
        keys = list(dict.fromkeys(pairs[r].key for r in rows))
        slot = {key: i for i, key in enumerate(keys)}
        image_index = torch.tensor([slot[pairs[r].key] for r in rows], device=self.device)  # (Bq,)
        context = ImageContext.cat([encoded[key].context for key in keys])
        tokens = self.model.processor.tokenize([pairs[r].question for r in rows])
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
            pairs[row].error = non_finite(scores[j].tolist(), "scores")
            if pairs[row].error is not None:
                if raise_errors:
                    raise ValueError(f"{pairs[row].name}: {pairs[row].error}")
                continue
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
        if pair.unknown_words:
            result["unknown_words"] = list(pair.unknown_words)
        if pair.low_confidence and pair.error is None:
            result["low_confidence"] = True
        return result


def count_unknown_words(
    question: str, ids: list[int], offsets: list[tuple[int, int]], word_ids: list[int | None], unk_id: int
) -> tuple[int, int]:
    """``(unknown, total)``: how many words of ``question`` the tokenizer does not know, of how many.

    A word is one of the tokenizer's words (its ``word_ids``) with a letter or digit in it
    (punctuation does not count); it is unknown when one of its tokens is ``unk_id``.
    """
    unknown: dict[int, bool] = {}
    for token, (start, end), word in zip(ids, offsets, word_ids):
        if word is not None and any(c.isalnum() for c in question[start:end]):
            unknown[word] = unknown.get(word, False) or token == unk_id
    return sum(unknown.values()), len(unknown)
