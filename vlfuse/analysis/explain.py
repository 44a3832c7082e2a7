"""Why a model gave an answer: maps over the image of where the question looked, eight ways.

Every method works through the model's public stages (:meth:`~vlfuse.model.VLFuseModel.encode_images`,
``encode_questions``, ``fuse`` with ``weights_from``, ``read_out``); none patches a layer:

- :class:`RawAttention` (``attention``): one fusion layer's cross-attention weights, per head.
- :class:`AttentionGradient` (``gradcam``): those weights times the positive part of the gradient
  of the chosen answer's logit with respect to them, per head (the Grad-CAM of LAVIS's
  ``compute_gradcam``, Chefer et al. 2021's ``A * relu(dy/dA)``).
- :class:`Rollout` (``rollout``): attention rolled out across every fusion layer (Abnar and
  Zuidema 2020), each layer mixed half and half with the identity (the residual stream).
- :class:`InputGradient` (``input_gradient``): ``|dy/dpixels|`` pooled onto the patch grid, a
  baseline that ignores attention (one map for the question: no heads, no tokens).
- :class:`Occlusion` (``occlusion``): each patch painted over in turn with the image's median
  colour, and how much the answer's log-odds change (Zeiler and Fergus 2014): reads no
  attention, only what the answer depends on (one map for the question: no heads, no tokens).
- :class:`FindGradient` (``find_gradient``): for the SHAPES cell readers, which see the image only
  through each word's finds: each find's share in the answer's log-probability, per find head.
- :class:`ReaderSet` (``reader_set``): for the cell readers, the soft set they hold once each word
  is read, and once the whole question is.
- :class:`WordSet` (``word_set``): for the cell readers, the set each word picks out when the
  reader reads it alone (which word looked where, as a neural module network's module maps).

The gradient with respect to the weights is read without hooks. A layer's output for question
token ``q`` and head ``h`` is ``o[h, q] = sum_k A[h, q, k] V[h, k]`` with the values ``V`` in the
image context, so ``dy/dV[h] = A[h]^T g[h]`` where ``g[h, q] = dy/do[h, q]``. The real tokens'
attention rows are linearly independent whenever tokens attend differently, so ``g`` is
``pinv(A[h]^T) dy/dV[h]`` and ``dy/dA[h, q, k] = g[h, q] . V[h, k]``, exactly; tokens whose rows are
identical share their gradient evenly (the minimum-norm solution).

:func:`explain` returns an :class:`Explanation`: maps over the image tokens (prefix tokens, then
the patch grid) per head and per question token, and one map for the whole question.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from vlfuse.analysis.attention_maps import overlay_figure, split_prefix
from vlfuse.fusers import CellStepsFuser
from vlfuse.layers import ProjectedContext
from vlfuse.model import ImageContext, VLFuseModel

RESIDUAL_SHARE = 0.5
"""In rollout, the share of a token's state that a layer keeps (the identity of ``0.5 A + 0.5 I``)."""
OCCLUSION_BATCH = 32
"""Occluded images :class:`Occlusion` encodes at once (its memory: ViT-B at 224 px has 196 patches)."""


class MethodRefused(ValueError):
    """The explanation method cannot explain this model (its fuser lacks what the method reads);
    the message names the method and says why."""


@dataclass
class Explanation:
    """The maps of one method for one question about one image.

    Attributes:
        method: the method's name (a key of :data:`METHODS`).
        answer: the answer explained (the predicted one unless one was asked for).
        answer_index: its index in the model's answers.
        probability: the model's probability of that answer.
        tokens: the question's real tokens, as the tokenizer wrote them.
        token_maps: ``(heads, tokens, Li)`` a map per head and per question token over the image
            tokens (prefix tokens first, then the patch grid row by row), or ``None`` for a method
            without tokens (``input_gradient``). One "head" for the methods that mix heads.
        question_map: ``(Li,)`` the whole question's map: non-negative, summing to 1 (the mean
            over heads and tokens, normalised; uniform when the method gives nothing).
        grid: ``(rows, cols)`` of the patch grid.
        num_prefix_tokens: image tokens before the grid (their map values have no place).
        heads: labels of the ``heads`` rows (original head ids, or the name of the mix).
        layer: the fusion layer read, or ``None`` for methods over every layer or none.
    """

    method: str
    answer: str
    answer_index: int
    probability: float
    tokens: list[str]
    token_maps: np.ndarray | None
    question_map: np.ndarray
    grid: tuple[int, int]
    num_prefix_tokens: int
    heads: list[str]
    layer: int | None

    def patch_map(self) -> np.ndarray:
        """The whole question's map on the patch grid ``(rows, cols)``."""
        maps, _ = split_prefix(torch.as_tensor(self.question_map)[None], self.grid, self.num_prefix_tokens)
        return maps[0].numpy()

    def token_patch_maps(self) -> np.ndarray | None:
        """``(heads, tokens, rows, cols)``: :attr:`token_maps` on the patch grid (``None`` without tokens)."""
        if self.token_maps is None:
            return None
        heads, tokens, length = self.token_maps.shape
        flat = torch.as_tensor(self.token_maps).reshape(heads * tokens, length)
        maps, _ = split_prefix(flat, self.grid, self.num_prefix_tokens)
        return maps.reshape(heads, tokens, *self.grid).numpy()  # from (heads * tokens, rows, cols)


@dataclass
class Prepared:
    """One question about one image, ready for the methods.

    Attributes:
        pixels: ``(1, 3, S, S)`` the image as the model sees it.
        input_ids, text_mask: ``(1, Lt)`` the tokenized question.
        answer_index: the answer to explain, or ``None`` for the predicted one.
    """

    pixels: torch.Tensor
    input_ids: torch.Tensor
    text_mask: torch.Tensor
    answer_index: int | None


@dataclass
class MethodResult:
    """What a method computes: token maps ``(heads, T, Li)`` or ``None``, the question map ``(Li,)``
    before normalisation, the logits ``(num_answers,)``, and the answer explained."""

    token_maps: torch.Tensor | None
    question_map: torch.Tensor
    logits: torch.Tensor
    answer_index: int


class ExplanationMethod:
    """One way of explaining an answer (see :data:`METHODS`); :meth:`run` computes its maps.

    Class attributes:
        name: its name on the command line.
        per_layer: it reads one fusion layer (``layer``), not all of them.
    """

    name: ClassVar[str]
    per_layer: ClassVar[bool] = False

    def run(self, model: VLFuseModel, inputs: Prepared, layer: int) -> MethodResult:
        raise NotImplementedError

    def head_labels(self, model: VLFuseModel, layer: int, rows: int) -> list[str]:
        """Labels of the ``rows`` rows of the token maps :meth:`run` gives: a per-layer method's rows are
        the layer's heads (original ids); any other method mixes them into one row."""
        if self.per_layer:
            return [f"head {h}" for h in model.fusion_head_ids[layer]]
        return [f"{self.name} (heads mixed)"]

    @staticmethod
    def fused_logits(
        model: VLFuseModel, inputs: Prepared, context: ImageContext, layers: Sequence[int]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Logits ``(num_answers,)`` and the weights ``{layer: (H, T, Li)}`` of the real tokens."""
        mask = inputs.text_mask
        text = model.encode_questions(inputs.input_ids, mask.long())
        fused = model.fuse(text, mask, context, weights_from=layers)
        logits = model.read_out(fused.output, mask)[0]
        return logits, {layer: weights[0][:, mask[0]] for layer, weights in fused.attentions.items()}


def _chosen(logits: torch.Tensor, inputs: Prepared) -> int:
    return int(logits.argmax()) if inputs.answer_index is None else inputs.answer_index


class RawAttention(ExplanationMethod):
    """The cross-attention weights of one fusion layer, per head and per question token."""

    name = "attention"
    per_layer = True

    def run(self, model: VLFuseModel, inputs: Prepared, layer: int) -> MethodResult:
        with torch.no_grad():
            logits, weights = self.fused_logits(model, inputs, model.encode_images(inputs.pixels), [layer])
        maps = weights[layer]  # (H, T, Li)
        return MethodResult(maps, maps.mean((0, 1)), logits, _chosen(logits, inputs))


class AttentionGradient(ExplanationMethod):
    """Grad-CAM over cross-attention: ``A * relu(dy/dA)`` per head and token, ``y`` the answer's logit.

    The question's map is the mean over heads and tokens (LAVIS averages over both). The gradient
    is read through the layer's values (see the module docstring), which needs a fuser whose image
    context holds each attention layer's keys and values (the fusion stack).
    """

    name = "gradcam"
    per_layer = True

    def run(self, model: VLFuseModel, inputs: Prepared, layer: int) -> MethodResult:
        with torch.no_grad():
            features = model.encode_images(inputs.pixels).features
        if not (isinstance(features, list) and len(features) == model.num_fusion_layers
                and all(isinstance(kv, ProjectedContext) for kv in features)):
            raise MethodRefused(
                f"method 'gradcam' reads each attention layer's values from the image context; fuser "
                f"{model.config.fuser.type!r} does not keep them (use another method)"
            )
        value = features[layer].value.detach().requires_grad_()  # (1, H, Li, hd)
        features = [dataclasses.replace(kv, value=value) if i == layer else kv for i, kv in enumerate(features)]
        with torch.enable_grad():
            logits, weights = self.fused_logits(model, inputs, ImageContext(features), [layer])
            chosen = _chosen(logits, inputs)
            [value_grad] = torch.autograd.grad(logits[chosen], value)
        attention = weights[layer].detach()  # (H, T, Li)
        gradient = weights_gradient(attention, value[0].detach(), value_grad[0])
        maps = attention * gradient.clamp_min(0)
        return MethodResult(maps, maps.mean((0, 1)), logits.detach(), chosen)


def weights_gradient(attention: torch.Tensor, value: torch.Tensor, value_grad: torch.Tensor) -> torch.Tensor:
    """``dy/dA`` ``(H, T, Li)`` from the weights ``A`` ``(H, T, Li)``, the values ``V`` ``(H, Li, hd)``
    and ``dy/dV`` ``(H, Li, hd)`` of a layer whose output is ``A V``: ``g = pinv(A^T) dy/dV``
    ``(H, T, hd)``, then ``g V^T``. Computed in float64."""
    a, v, u = attention.double(), value.double(), value_grad.double()
    read = torch.linalg.pinv(a.transpose(1, 2)) @ u  # (H, T, hd): dy/d(each head's read of each token)
    return (read @ v.transpose(1, 2)).to(attention.dtype)  # (H, T, Li)


class Rollout(ExplanationMethod):
    """Attention rolled out across the fusion layers (Abnar and Zuidema 2020), heads averaged.

    The image tokens do not change from layer to layer; a question token keeps its state
    (the residual) and reads the image. With each layer's rows mixed as ``0.5 A + 0.5 I`` over
    [question tokens, image tokens], the product of the layers gives each token the image share
    ``r_l = 0.5 r_(l-1) + 0.5 mean_h A_l`` (``r_0 = 0``), normalised here to sum to 1. One layer's
    rollout is its head-mean attention. Needs a fuser without text self-attention (whose weights the
    model does not return).
    """

    name = "rollout"

    def run(self, model: VLFuseModel, inputs: Prepared, layer: int) -> MethodResult:
        if getattr(model.config.fuser, "self_attention", False):
            raise MethodRefused("method 'rollout' needs a fuser without text self-attention: its weights are not returned")
        layers = list(range(model.num_fusion_layers))
        with torch.no_grad():
            logits, weights = self.fused_logits(model, inputs, model.encode_images(inputs.pixels), layers)
        rolled = torch.zeros_like(weights[0][0])  # (T, Li)
        for i in layers:
            rolled = RESIDUAL_SHARE * rolled + (1 - RESIDUAL_SHARE) * weights[i].mean(0)
        rolled = rolled / rolled.sum(-1, keepdim=True).clamp_min(1e-12)
        return MethodResult(rolled[None], rolled.mean(0), logits, _chosen(logits, inputs))


class InputGradient(ExplanationMethod):
    """``|dy/dpixels|`` summed over colour channels and averaged over each patch (Simonyan et al.
    2014): where a small change of the image changes the answer's logit most. No heads, no tokens."""

    name = "input_gradient"

    def run(self, model: VLFuseModel, inputs: Prepared, layer: int) -> MethodResult:
        pixels = inputs.pixels.detach().requires_grad_()
        with torch.enable_grad():
            logits, _ = self.fused_logits(model, inputs, model.encode_images(pixels), [])
            chosen = _chosen(logits, inputs)
            [grad] = torch.autograd.grad(logits[chosen], pixels)
        saliency = grad[0].abs().sum(0)[None, None]  # (1, 1, S, S)
        patches = F.adaptive_avg_pool2d(saliency, tuple(model.image_encoder.grid_size)).flatten()  # (rows * cols,)
        prefix = patches.new_zeros(model.attention_prefix_tokens)
        return MethodResult(None, torch.cat([prefix, patches]), logits.detach(), chosen)


class Occlusion(ExplanationMethod):
    """Occlusion sensitivity (Zeiler and Fergus 2014): each patch of the grid in turn painted over
    with the image's median colour (per channel); a patch's value is how much that changes the
    log-odds of the chosen answer (:func:`log_odds`), either way. One map for the question: no
    heads, no tokens.

    It reads no attention, so it sees what an attention map over the image encoder's output tokens
    cannot: a token that the encoder's own self-attention filled with another patch's content. The
    median colour is that of most of the image (the background of an easy-VQA or SHAPES image), so
    painting over a patch that shows nothing the answer needs changes little. Either way, because
    painting over part of an object can make a model surer of the object's colour or shape: a map
    of the falls alone is then flat. The log-odds rather than the logit, because an existence head's
    "false" logit is a constant (as in :class:`FindGradient`); rather than the log-probability,
    which saturates for a confident answer (at ``p = 0.9999`` a change of 1 in the log-odds moves
    ``log p`` by about 2e-4). Costs a forward pass per patch, :data:`OCCLUSION_BATCH` images at a time.

    A patch already of the median colour is left unchanged and scores 0: on one object on a plain
    ground, the map can point only at the object's patches, whatever the model learnt (an untrained
    model's map does too: ``scripts/pointing_game.py --untrained-baseline``).
    """

    name = "occlusion"

    def run(self, model: VLFuseModel, inputs: Prepared, layer: int) -> MethodResult:
        mask = inputs.text_mask

        def answer_logits(pixels: torch.Tensor) -> torch.Tensor:  # (n, 3, S, S) -> (n, num_answers)
            count = len(pixels)
            fused = model.fuse(text.expand(count, -1, -1), mask.expand(count, -1), model.encode_images(pixels))
            return model.read_out(fused.output, mask.expand(count, -1))

        with torch.no_grad():
            text = model.encode_questions(inputs.input_ids, mask.long())  # (1, Lt, D): once for every image
            logits = answer_logits(inputs.pixels)  # (1, num_answers)
            chosen = _chosen(logits[0], inputs)
            changes = occlusion_changes(
                inputs.pixels, tuple(model.image_encoder.grid_size), lambda pixels: log_odds(answer_logits(pixels), chosen),
                log_odds(logits, chosen),
            )  # (patches,)
        prefix = changes.new_zeros(model.attention_prefix_tokens)
        return MethodResult(None, torch.cat([prefix, changes]), logits[0], chosen)


def occluded_images(pixels: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """``pixels`` ``(3, S, S)`` once per patch of ``grid`` ``(rows, cols)``, that patch painted with the
    median of each channel: ``(rows * cols, 3, S, S)``, row by row. A patch spans ``S / rows`` by
    ``S / cols`` pixels, rounded down at its edges (the grid of an image size the patches do not divide)."""
    rows, cols = grid
    height, width = pixels.shape[1:]
    fill = pixels.flatten(1).median(-1).values[:, None, None]  # (3, 1, 1)
    occluded = pixels.repeat(rows * cols, 1, 1, 1)
    for cell, image in enumerate(occluded):
        r, c = divmod(cell, cols)
        image[:, r * height // rows:(r + 1) * height // rows, c * width // cols:(c + 1) * width // cols] = fill
    return occluded


def occlusion_changes(
    pixels: torch.Tensor, grid: tuple[int, int], score: Callable[[torch.Tensor], torch.Tensor], unoccluded: torch.Tensor
) -> torch.Tensor:
    """``|score(occluded) - unoccluded|`` ``(patches, ...)`` for each of :func:`occluded_images` of
    ``pixels`` ``(1, 3, S, S)``; ``score`` maps images ``(n, 3, S, S)`` to ``(n, ...)``, ``unoccluded``
    is its value ``(1, ...)`` on ``pixels``. The images go :data:`OCCLUSION_BATCH` at a time."""
    occluded = occluded_images(pixels[0], grid)  # (patches, 3, S, S)
    return torch.cat([(score(chunk) - unoccluded).abs() for chunk in occluded.split(OCCLUSION_BATCH)])


def log_odds(logits: torch.Tensor, answer: int | torch.Tensor) -> torch.Tensor:
    """``log(p / (1 - p))`` of ``answer`` from ``logits`` ``(..., classes)``: its logit less the
    log-sum-exp of the others', exact where ``p`` rounds to 1 in float32 (a confident answer).
    ``answer``: one class for every row, or a class per row (``(...)``, broadcast) -> ``(...)``."""
    index = torch.as_tensor(answer, device=logits.device).expand(logits.shape[:-1])[..., None]  # (..., 1)
    others = logits.scatter(-1, index, float("-inf"))
    return logits.gather(-1, index)[..., 0] - others.logsumexp(-1)


class FindGradient(ExplanationMethod):
    """The SHAPES cell readers' answer traced to each word's finds: ``relu(s * d log p / ds)`` per
    find head, word and cell, ``s`` the word's find score of the cell (:meth:`CellStepsFuser.finds`)
    and ``p`` the probability of the chosen answer.

    The readers see the image only through the finds, so this is the first-order share of each
    find in the answer (gradient times input), kept where it speaks for the answer. It explains
    ``log p`` rather than the logit because the existence head's "false" logit is the constant 0,
    whose gradient is nothing. Only for ``cell_steps`` and ``cell_moves``.
    """

    name = "find_gradient"

    def run(self, model: VLFuseModel, inputs: Prepared, layer: int) -> MethodResult:
        reader, text, patches = read_by_cells(model, inputs, self.name)
        mask = inputs.text_mask
        with torch.no_grad():
            scores = reader.finds(text, patches)  # (1, Lt, cells, H)
        scores.requires_grad_()
        with torch.enable_grad():
            logits = model.read_out(reader.read_finds(text, mask, patches, scores), mask)[0]
            chosen = _chosen(logits, inputs)
            [grad] = torch.autograd.grad(logits.log_softmax(-1)[chosen], scores)
        shares = (scores * grad).detach()[0][mask[0]].clamp_min(0)  # (T, cells, H)
        maps = shares.permute(2, 0, 1)  # (H, T, cells)
        return MethodResult(maps, maps.mean((0, 1)), logits.detach(), chosen)

    def head_labels(self, model: VLFuseModel, layer: int, rows: int) -> list[str]:
        return [f"find head {h}" for h in range(rows)]


class ReaderSet(ExplanationMethod):
    """The SHAPES cell readers' own answer: the soft set ``m`` they hold, the cells the question is
    found true of. The question's map is the set once every word is read (whose existence is the
    answer); word ``t``'s map is the set once word ``t`` is read (the words are read last first, so
    an early word's map comes late in the reading). One "head". Only for ``cell_steps`` and ``cell_moves``.
    """

    name = "reader_set"

    def run(self, model: VLFuseModel, inputs: Prepared, layer: int) -> MethodResult:
        reader, text, patches = read_by_cells(model, inputs, self.name)
        mask = inputs.text_mask
        with torch.no_grad():
            sets = reader.states(text, mask, patches)[0]  # (Lt, cells): row t once word t is read
            logits = model.read_out(reader(text, mask, patches).output, mask)[0]
        maps = sets[mask[0]][None]  # (1, T, cells)
        return MethodResult(maps, sets[0], logits, _chosen(logits, inputs))


class WordSet(ExplanationMethod):
    """The SHAPES cell readers' reading of each word alone: word ``t``'s map is the soft set the
    reader holds once it has read word ``t`` by itself, from the whole grid (as it reads the first
    word of every question), so "green" maps to the cells it finds green and "circle" to those it
    finds a circle, in this image. The question's map is their mean. The answer explained is the
    whole question's, as :class:`ReaderSet`'s. One "head". Only for ``cell_steps`` and ``cell_moves``.
    """

    name = "word_set"

    def run(self, model: VLFuseModel, inputs: Prepared, layer: int) -> MethodResult:
        reader, text, patches = read_by_cells(model, inputs, self.name)
        mask = inputs.text_mask
        words = text[0][mask[0]][:, None, :]  # (T, 1, width): each real token, a question of one word
        with torch.no_grad():
            alone = torch.ones(words.shape[:2], dtype=torch.bool, device=words.device)  # (T, 1)
            sets = reader.states(words, alone, patches.expand(len(words), -1, -1))  # (T, 1, cells)
            logits = model.read_out(reader(text, mask, patches).output, mask)[0]
        maps = sets[:, 0][None]  # (1, T, cells)
        return MethodResult(maps, maps.mean((0, 1)), logits, _chosen(logits, inputs))


def read_by_cells(model: VLFuseModel, inputs: Prepared, method: str) -> tuple[CellStepsFuser, torch.Tensor, torch.Tensor]:
    """The model's cell reader with what it reads, the words ``(1, Lt, width)`` and the patches
    ``(1, cells, d)``; :class:`MethodRefused` naming ``method`` and the fuser when it has no cell reader."""
    if not isinstance(model.fuser, CellStepsFuser):
        raise MethodRefused(
            f"method {method!r} reads a cell reader (cell_steps, cell_moves); fuser {model.config.fuser.type!r} is not one"
        )
    with torch.no_grad():
        patches = model.encode_images(inputs.pixels).features
        text = model.encode_questions(inputs.input_ids, inputs.text_mask.long())
    return model.fuser, text, patches


METHODS: dict[str, type[ExplanationMethod]] = {
    method.name: method for method in (
        RawAttention, AttentionGradient, Rollout, InputGradient, Occlusion, FindGradient, ReaderSet, WordSet
    )
}
"""The explanation methods by name."""


def untrained_copy(model: VLFuseModel, seed: int = 0) -> VLFuseModel:
    """A model of ``model``'s architecture, answers and processor with freshly initialised weights
    (drawn with ``seed``; no pretrained weights loaded), in eval mode: the model randomisation
    check of Adebayo et al. 2018, "Sanity checks for saliency maps". A method whose maps of this
    model point as well as its maps of ``model`` shows the image, not what the model learnt.
    The global random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        copy = VLFuseModel(
            model.config, model.answers, model.processor,
            text_hf_config=model.text_encoder.model.config, load_pretrained=False,
        )
    return copy.to(next(model.parameters()).device).eval()


def chosen_index(layer: int | None, layers: int, what: str) -> int:
    """``layer`` of ``layers`` as an index in ``0..layers - 1`` (``None``: the last; negative: from the end).

    Raises:
        ValueError: ``layer`` is out of range (the message says ``what`` the layers are, e.g. "the model has fusion layers").
    """
    chosen = layers - 1 if layer is None else layer
    if not -layers <= chosen < layers:
        raise ValueError(f"layer {layer} out of range: {what} 0..{layers - 1}")
    return chosen % layers


def distribution(values: torch.Tensor) -> torch.Tensor:
    """``values`` ``(Li,)`` clamped at 0 and normalised to sum to 1 (uniform when nothing is left)."""
    total = values.clamp_min(0)
    return total / total.sum() if float(total.sum()) > 0 else torch.full_like(total, 1 / total.numel())


def answer_index(model: VLFuseModel, answer: str | None) -> int | None:
    """The index of ``answer`` among the model's answers (``None`` stays ``None``: the predicted one)."""
    if answer is None:
        return None
    if answer not in model.answers:
        shown = ", ".join(repr(a) for a in model.answers[:20]) + (", ..." if len(model.answers) > 20 else "")
        raise ValueError(f"answer {answer!r} is not one of the model's {len(model.answers)} answers: {shown}")
    return model.answers.index(answer)


def explain(
    model: VLFuseModel,
    image,
    question: str,
    method: str = "gradcam",
    *,
    answer: str | None = None,
    layer: int | None = None,
) -> Explanation:
    """Explain the model's answer to ``question`` about ``image`` with ``method`` (see :data:`METHODS`).

    Args:
        model: an answering model with cross-attention heads (in eval mode).
        image: a path, PIL image, array or tensor (anything :meth:`VLFuseProcessor.image` reads).
        question: the question.
        method: a key of :data:`METHODS`.
        answer: the answer to explain (one of ``model.answers``); default the predicted one.
        layer: the fusion layer of ``attention`` and ``gradcam`` (default the last); negative counts from the end.
    """
    return explain_pixels(model, model.processor.image(image)[None], question, method, answer=answer, layer=layer)


def explain_pixels(
    model: VLFuseModel,
    pixels: torch.Tensor,
    question: str,
    method: str = "gradcam",
    *,
    answer: str | None = None,
    layer: int | None = None,
) -> Explanation:
    """:func:`explain` of an image already preprocessed: ``pixels`` ``(1, 3, S, S)`` in [0, 1]."""
    if method not in METHODS:
        raise ValueError(f"unknown explanation method {method!r}: choose from {', '.join(METHODS)}")
    model.require_fusion_heads("explain")
    chosen_layer = chosen_index(layer, model.num_fusion_layers, "the model has fusion layers")
    parameter = next(model.parameters())
    tokens = model.processor.tokenize([question])
    inputs = Prepared(
        pixels.to(parameter.device, parameter.dtype),
        tokens["input_ids"].to(parameter.device),
        tokens["attention_mask"].bool().to(parameter.device),
        answer_index(model, answer),
    )
    runner = METHODS[method]()
    result = runner.run(model, inputs, chosen_layer)
    words = model.tokenizer.convert_ids_to_tokens(inputs.input_ids[0][inputs.text_mask[0]].tolist())
    question_map = distribution(result.question_map)
    heads = runner.head_labels(model, chosen_layer, 1 if result.token_maps is None else result.token_maps.shape[0])
    return Explanation(
        method=method,
        answer=model.answers[result.answer_index],
        answer_index=result.answer_index,
        probability=float(result.logits.softmax(-1)[result.answer_index]),
        tokens=words,
        token_maps=None if result.token_maps is None else result.token_maps.float().cpu().numpy(),
        question_map=question_map.float().cpu().numpy(),
        grid=tuple(model.image_encoder.grid_size),
        num_prefix_tokens=model.attention_prefix_tokens,
        heads=heads,
        layer=chosen_layer if runner.per_layer else None,
    )


def draw_explanation(explanation: Explanation, pixels: torch.Tensor, directory: str | Path, stem: str) -> list[Path]:
    """Draw ``explanation`` over ``pixels`` ``(3, S, S)``: ``STEM_question.png`` (each head's map of
    the question and the whole question's) and ``STEM_words.png`` (each word's map, heads averaged,
    and the whole question's), one colour scale per figure. Returns the paths written."""
    e = explanation
    where = f"layer {e.layer}" if e.layer is not None else "all layers"
    title = f"{e.method}, {where}: -> {e.answer} ({e.probability:.2f})"
    return draw_maps(pixels, e.question_map, e.token_maps, e.tokens, e.heads, e.grid, e.num_prefix_tokens,
                     method=e.method, title=title, whole="question", directory=directory, stem=stem)


def draw_maps(
    pixels: torch.Tensor,
    whole_map: np.ndarray,
    token_maps: np.ndarray | None,
    tokens: Sequence[str],
    heads: Sequence[str],
    grid: tuple[int, int],
    num_prefix_tokens: int,
    *,
    method: str,
    title: str,
    whole: str,
    directory: str | Path,
    stem: str,
) -> list[Path]:
    """Draw a text's maps over ``pixels`` ``(3, S, S)``: ``STEM_WHOLE.png`` (``whole_map`` ``(Li,)``,
    beside each head's mean over the tokens when there are several heads) and, with ``token_maps``
    ``(heads, T, Li)``, ``STEM_words.png`` (each token's map, heads averaged). Returns the paths."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    image = pixels.permute(1, 2, 0).float().cpu().numpy()  # (S, S, 3)
    whole_panel = torch.as_tensor(whole_map)[None]  # (1, Li)
    label = f"whole {whole}"
    figures = {whole: (whole_panel, [label])}
    if token_maps is not None:
        maps = torch.as_tensor(token_maps)  # (heads, T, Li)
        scale = whole_panel.sum() / maps.mean((0, 1)).sum().clamp_min(1e-12)  # the whole map's units
        if len(heads) > 1:
            figures[whole] = (torch.cat([maps.mean(1) * scale, whole_panel]), list(heads) + [label])
        words = [f"word {t}: {token!r}" for t, token in enumerate(tokens)]
        figures["words"] = (torch.cat([maps.mean(0) * scale, whole_panel]), words + [label])
    paths = []
    for name, (panels, labels) in figures.items():
        figure = overlay_figure(
            image, panels, labels, grid, num_prefix_tokens, title=title,
            bar_label=f"{method} map (one scale for all panels)",
        )
        path = directory / f"{stem}_{name}.png"
        figure.savefig(path, dpi=80)
        paths.append(path)
    return paths
