"""Caption generation: greedy decoding and beam search, with a key/value cache.

The image keys/values of every block are projected once per image (:meth:`CaptionModel.encode_images`);
beams share them through ``image_index``. With the cache, each step feeds only the newest token:
the self-attention keys/values of the earlier ones are kept (:class:`~vlfuse.layers.causal.KVCache`).
Without it (``use_cache=False``, for comparison), every step runs the decoder over the whole prefix.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlfuse.heads.caption_decoder import DecoderCache
from vlfuse.captioning.model import CaptionModel
from vlfuse.model import ImageContext


@dataclass
class Caption:
    """One generated caption.

    Attributes:
        text: the words, joined by spaces.
        ids: the generated token ids after the begin token, up to and including the end token if written.
        score: the sum of the tokens' log-probabilities (beam search: divided by ``len(ids) ** length_penalty``).
        attentions: ``{layer: (H, len(ids), Li)}`` the cross-attention of each generated token over the
            image tokens, for the layers asked for (empty otherwise).
    """

    text: str
    ids: list[int]
    score: float
    attentions: dict[int, torch.Tensor] = field(default_factory=dict)


class _Steps:
    """Feeds a growing batch of token rows to the decoder, one step at a time, with or without the cache."""

    def __init__(
        self, model: CaptionModel, context: ImageContext, image_index: torch.Tensor | None, use_cache: bool, layers
    ) -> None:
        # every step reads all the image keys/values: laid out head by head, a batch takes 3-4% less time
        self.model, self.context, self.image_index, self.layers = model, context.contiguous(), image_index, tuple(layers)
        self.cache: DecoderCache | None = model.new_cache() if use_cache else None

    def scores(self, tokens: torch.Tensor) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``tokens`` ``(R, T)`` -> log-probabilities of the next token ``(R, vocab)`` and each asked layer's
        cross-attention of the newest token ``(R, H, Li)``."""
        fed = tokens if self.cache is None else tokens[:, self.cache.length :]
        out = self.model.decode(fed, self.context, image_index=self.image_index, cache=self.cache, weights_from=self.layers)
        weights = {layer: w[:, :, -1] for layer, w in out.attentions.items()}  # (R, H, Li) each
        return out.logits[:, -1].float().log_softmax(-1), weights

    def select(self, rows: torch.Tensor) -> None:
        """Follow the rows ``rows`` (beam search's surviving beams, greedy's unfinished captions); the
        image of each row moves with it."""
        if self.cache is not None:
            self.cache.select(rows)
        if self.image_index is not None:
            self.image_index = self.image_index[rows]
        else:
            self.context = self.context.select(rows)


LEAVE_AT = 0.125
"""Greedy decoding drops the rows of ended captions from its batch once they are this share of its
rows: each drop copies the self-attention cache, so dropping every row as it ends costs more than
it saves (``scripts/bench_trained_generation.py --leave-at``, docs/results.md)."""


def _limit(model: CaptionModel, max_length: int | None) -> int:
    """Tokens a caption may have after the begin token: ``max_length``, or all the decoder's positions."""
    available = model.config.max_length - 1
    if max_length is None:
        return available
    if not 1 <= max_length <= available:
        raise ValueError(f"max_length must be in [1, {available}] (the decoder's positions after the begin token), got {max_length}")
    return max_length


def _captions(model, tokens, scores, attentions) -> list[Caption]:
    """Rows of ``tokens`` ``(B, 1 + T)`` (begin token first) -> captions, cut after the end token."""
    result = []
    for row, ids in enumerate(tokens[:, 1:].tolist()):
        length = ids.index(model.eos_id) + 1 if model.eos_id in ids else len(ids)
        drawn = {layer: w[row, :length].transpose(0, 1).cpu() for layer, w in attentions.items()}  # (H, T, Li)
        result.append(Caption(model.detokenize(ids[:length]), ids[:length], float(scores[row]), drawn))
    return result


@torch.no_grad()
def greedy(
    model: CaptionModel,
    image_context: ImageContext,
    *,
    max_length: int | None = None,
    use_cache: bool = True,
    attention_layers=(),
) -> list[Caption]:
    """The most probable next word, each step, for every image of ``image_context`` (a batch).

    Captions that have written the end token leave the batch once they are :data:`LEAVE_AT` of its
    rows: later steps run the decoder on the captions still being written (their cache rows and
    images with them); until then an ended caption's row runs on and what it writes is dropped.

    Args:
        model: the caption model (call in eval mode).
        image_context: from :meth:`CaptionModel.encode_images`.
        max_length: the most tokens after the begin token (the end token included); default: all positions.
        use_cache: keep the self-attention keys/values; ``False`` re-runs the whole prefix each step.
        attention_layers: blocks whose cross-attention to record for each generated token.
    """
    limit = _limit(model, max_length)
    rows = image_context.features[0].batch_size
    device = image_context.features[0].key.device
    tokens = torch.full((rows, 1 + limit), model.pad_id, dtype=torch.long, device=device)
    tokens[:, 0] = model.bos_id
    caption = torch.arange(rows, device=device)  # (R,) the caption each decoder row writes
    writing = torch.ones(rows, dtype=torch.bool, device=device)  # (R,) rows whose caption has not ended
    steps = _Steps(model, image_context, None, use_cache, attention_layers)
    scores = torch.zeros(rows, device=device)
    history: dict[int, torch.Tensor] = {}
    for step in range(1, limit + 1):
        log_probs, weights = steps.scores(tokens[caption, :step])
        best, word = log_probs.max(-1)  # (R,)
        mine = caption[writing]  # the captions still being written
        scores[mine] += best[writing]
        tokens[mine, step] = word[writing]
        for layer, w in weights.items():  # w: (R, H, Li)
            if layer not in history:
                history[layer] = w.new_zeros(rows, limit, *w.shape[1:])  # (B, T, H, Li)
            history[layer][mine, step - 1] = w[writing]
        writing &= word != model.eos_id
        still = int(writing.sum())
        if still == 0:
            break
        if len(writing) - still >= LEAVE_AT * len(writing):  # enough ended captions to be worth a copy of the cache
            kept = writing.nonzero().squeeze(1)
            caption, writing = caption[kept], writing[kept]
            steps.select(kept)
    attentions = {layer: w[:, :step] for layer, w in history.items()}
    return _captions(model, tokens[:, : 1 + step], scores, attentions)


@torch.no_grad()
def beam_search(
    model: CaptionModel,
    image_context: ImageContext,
    *,
    beam_size: int = 3,
    length_penalty: float = 1.0,
    max_length: int | None = None,
    attention_layers=(),
) -> list[Caption]:
    """The best of ``beam_size`` hypotheses kept at each step, for every image of ``image_context``.

    Each step extends every unfinished hypothesis by every word and keeps the ``beam_size`` with
    the highest summed log-probability; a finished one (it wrote the end token) keeps its score.
    At the end each image's hypotheses are ranked by ``score / len(ids) ** length_penalty``
    (0: no normalisation, favouring short captions; 1: the mean log-probability per token).
    ``beam_size=1`` is greedy decoding.

    Args:
        model, image_context, max_length, attention_layers: as for :func:`greedy`.
        beam_size: hypotheses kept per image.
        length_penalty: the exponent of the length normalisation.
    """
    if beam_size < 1:
        raise ValueError(f"beam_size must be at least 1, got {beam_size}")
    limit = _limit(model, max_length)
    images = image_context.features[0].batch_size
    device = image_context.features[0].key.device
    rows = images * beam_size
    first_row = torch.arange(images, device=device) * beam_size  # (B,) each image's first beam row
    tokens = torch.full((rows, 1), model.bos_id, dtype=torch.long, device=device)
    steps = _Steps(model, image_context, torch.arange(images, device=device).repeat_interleave(beam_size), True, attention_layers)
    scores = torch.full((images, beam_size), float("-inf"), device=device)
    scores[:, 0] = 0.0  # the beams start identical: expand only the first
    done = torch.zeros(rows, dtype=torch.bool, device=device)
    history: dict[int, torch.Tensor] = {}
    for _ in range(limit):
        log_probs, weights = steps.scores(tokens)  # (R, V)
        vocab = log_probs.shape[-1]
        # a finished hypothesis has one continuation, padding, which costs nothing
        log_probs[done] = float("-inf")
        log_probs[done, model.pad_id] = 0.0
        candidates = (scores.reshape(rows, 1) + log_probs).reshape(images, beam_size * vocab)
        scores, index = candidates.topk(beam_size, dim=-1)  # (B, K)
        chosen = (first_row[:, None] + torch.div(index, vocab, rounding_mode="floor")).reshape(rows)
        word = (index % vocab).reshape(rows)
        tokens = torch.cat([tokens[chosen], word[:, None]], dim=1)
        steps.select(chosen)
        for layer, w in weights.items():
            so_far = history.get(layer, w.new_zeros(rows, 0, *w.shape[1:]))
            history[layer] = torch.cat([so_far, w[:, None]], dim=1)[chosen]  # (R, T, H, Li)
        done = done[chosen] | (word == model.eos_id)
        if bool(done.all()):
            break
    generated = tokens[:, 1:]
    lengths = torch.where(
        (generated == model.eos_id).any(-1), (generated == model.eos_id).int().argmax(-1) + 1, generated.shape[1]
    )  # (R,) tokens up to and including the end token
    ranked = scores.reshape(rows) / lengths.float() ** length_penalty
    best = first_row + ranked.reshape(images, beam_size).argmax(-1)  # (B,)
    return _captions(model, tokens[best], ranked[best], {layer: w[best] for layer, w in history.items()})
