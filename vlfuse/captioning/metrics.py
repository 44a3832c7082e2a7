"""Caption metrics: BLEU-4 and CIDEr-D as coco-caption computes them, and the SHAPES grammar's checks.

:func:`bleu4` and :func:`cider_d` follow the coco-caption evaluation code (as packaged in
pycocoevalcap 1.2), which scores captions after its Java PTB tokenizer; here
:func:`tokenize_caption` stands in for that tokenizer (see its docstring for the differences).
On tokenised text the scores are those of pycocoevalcap (the tests hold values it computed).

- BLEU-4 is corpus-level: clipped n-gram matches and candidate n-grams (n = 1..4) are summed over
  all images, their precisions combined by a geometric mean, with the brevity penalty on the summed
  lengths, the reference length of an image being that of its reference closest in length to the
  candidate (the shorter one on a tie).
- CIDEr-D: per image, for n = 1..4, the cosine similarity of the candidate's and each reference's
  TF-IDF n-gram vectors, the candidate's weights clipped at the reference's, times a Gaussian
  penalty on their length difference (sigma = 6); averaged over n and over the references, times
  10, then averaged over images. Document frequencies come from the references of the evaluated
  set, so the score of an image depends on the others (a single image always scores 0).

:class:`CaptionScores` and :class:`SceneCaptionScores` are torchmetrics Metrics for the two kinds
of evaluation, safe under DDP.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Sequence

import torch
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from vlfuse.captioning.grammar import fact_precision, object_recall
from vlfuse.data.shapes import Scene

MAX_N = 4
SIGMA = 6.0
"""Standard deviation, in words, of CIDEr-D's Gaussian length penalty."""
_TINY, _SMALL = 1e-15, 1e-9
"""coco-caption's guards in BLEU's ratios (a precision with no match is tiny, not 0/0)."""

_DROPPED = frozenset(".?!,:;-'\"`()[]{}")
"""Punctuation that coco-caption removes after tokenising (its PTB forms ``-LRB-``, ``''``... included)."""
_CLITIC = re.compile(r"(?<=\w)(n't|'s|'re|'ll|'ve|'m|'d)\b")
_TOKEN = re.compile(r"n't|'[a-z]+|\w+(?:[-.]\w+)*|[^\w\s]")
"""A clitic, a word (hyphenated words and decimal numbers stay whole), or one other character."""


def tokenize_caption(text: str) -> list[str]:
    """Lowercase ``text`` and split it into words as coco-caption's tokenizer does, punctuation dropped.

    A stand-in for the Stanford PTB tokenizer that coco-caption runs in Java: words are lowercased,
    clitics split off (``don't`` -> ``do n't``, ``dog's`` -> ``dog 's``), hyphenated words and
    decimals kept whole, and the punctuation coco-caption removes is dropped; any other symbol
    (``&``, ``$``, ``%``) is a word of its own. Rarer PTB rules (abbreviations such as ``u.s.``,
    ``cannot`` -> ``can not``) are not copied.
    """
    spaced = _CLITIC.sub(r" \1", text.lower())
    return [token for token in _TOKEN.findall(spaced) if token not in _DROPPED]


def _ngrams(words: Sequence[str]) -> Counter:
    """Counts of every n-gram (a tuple of words), n = 1..4."""
    return Counter(tuple(words[i : i + n]) for n in range(1, MAX_N + 1) for i in range(len(words) - n + 1))


def _check_aligned(generated: Sequence[str], references: Sequence[Sequence[str]]) -> None:
    """One generated caption and a non-empty list of references per image."""
    if len(generated) != len(references):
        raise ValueError(f"{len(generated)} generated captions but {len(references)} reference lists")
    for i, refs in enumerate(references):
        if isinstance(refs, str) or not refs:
            raise ValueError(f"image {i}: references must be a non-empty list of captions, got {refs!r}")


def _tokenized(generated: Sequence[str], references: Sequence[Sequence[str]]) -> tuple[list, list]:
    """Both sides tokenised, after :func:`_check_aligned`."""
    _check_aligned(generated, references)
    return [tokenize_caption(g) for g in generated], [[tokenize_caption(r) for r in refs] for refs in references]


def bleu4(generated: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """Corpus-level BLEU-4 of one generated caption per image against its references (0 for no image).

    Args:
        generated: one caption per image.
        references: the reference captions of each image (at least one each).
    """
    candidates, reference_lists = _tokenized(generated, references)
    if not candidates:
        return 0.0
    matched, guessed = [0] * MAX_N, [0] * MAX_N
    candidate_length = reference_length = 0
    for words, refs in zip(candidates, reference_lists):
        most = Counter()
        for ref in refs:
            most |= _ngrams(ref)  # the largest count of each n-gram in any one reference
        for ngram, count in _ngrams(words).items():
            matched[len(ngram) - 1] += min(count, most[ngram])
        for n in range(1, MAX_N + 1):
            guessed[n - 1] += max(0, len(words) - n + 1)
        candidate_length += len(words)
        reference_length += min((abs(len(ref) - len(words)), len(ref)) for ref in refs)[1]
    precision = math.prod((m + _TINY) / (g + _SMALL) for m, g in zip(matched, guessed))
    ratio = (candidate_length + _TINY) / (reference_length + _SMALL)
    brevity = math.exp(1 - 1 / ratio) if ratio < 1 else 1.0
    return precision ** (1 / MAX_N) * brevity


class _TfIdf:
    """The TF-IDF vectors of CIDEr, with document frequencies from a set of reference lists."""

    def __init__(self, reference_lists: Sequence[Sequence[Counter]]) -> None:
        self.document_frequency = Counter(ngram for refs in reference_lists for ngram in set().union(*refs))
        self.log_documents = math.log(len(reference_lists))

    def vector(self, counts: Counter) -> tuple[dict, list[float]]:
        """Weights of each n-gram and the norm of each order's vector (index n - 1)."""
        weights = {
            ngram: count * (self.log_documents - math.log(max(1.0, self.document_frequency[ngram])))
            for ngram, count in counts.items()
        }
        squares = [0.0] * MAX_N
        for ngram, weight in weights.items():
            squares[len(ngram) - 1] += weight**2
        return weights, [math.sqrt(s) for s in squares]


def _cider_similarity(candidate: tuple, reference: tuple, length_difference: int) -> float:
    """CIDEr-D of one candidate against one reference: the mean over n of the clipped cosine similarity,
    times the length penalty. ``candidate`` and ``reference`` are :meth:`_TfIdf.vector` pairs."""
    (weights, norms), (ref_weights, ref_norms) = candidate, reference
    products = [0.0] * MAX_N
    for ngram, weight in weights.items():
        ref_weight = ref_weights.get(ngram, 0.0)
        products[len(ngram) - 1] += min(weight, ref_weight) * ref_weight
    cosines = [p / (a * b) if a and b else p for p, a, b in zip(products, norms, ref_norms)]
    return sum(cosines) / MAX_N * math.exp(-(length_difference**2) / (2 * SIGMA**2))


def cider_d(generated: Sequence[str], references: Sequence[Sequence[str]]) -> float:
    """CIDEr-D of one generated caption per image against its references (0 for no image).

    Args:
        generated: one caption per image.
        references: the reference captions of each image (at least one each); their n-grams give
            the document frequencies.
    """
    candidates, reference_lists = _tokenized(generated, references)
    if not candidates:
        return 0.0
    reference_counts = [[_ngrams(ref) for ref in refs] for refs in reference_lists]
    tfidf = _TfIdf(reference_counts)
    scores = []
    for words, refs, counts in zip(candidates, reference_lists, reference_counts):
        candidate = tfidf.vector(_ngrams(words))
        similarity = sum(
            _cider_similarity(candidate, tfidf.vector(ref_counts), len(words) - len(ref))
            for ref, ref_counts in zip(refs, counts)
        )
        scores.append(10.0 * similarity / len(refs))
    return sum(scores) / len(scores)


# -------------------------------------------------------------------------------- torchmetrics


def _encode(texts: Sequence[str], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """UTF-8 bytes of each text, each followed by a 0 byte, as a 1-D tensor of ``dtype``.

    Metric states must be tensors to be gathered across processes. The dtype is the metric's own
    floating dtype because torchmetrics stands in an empty tensor of that dtype for a process that
    saw no data, and all processes must gather tensors of one dtype; byte values (0..255) are exact
    in every floating dtype, bfloat16 included.
    """
    data = bytearray()
    for i, text in enumerate(texts):
        if not isinstance(text, str) or "\0" in text:
            raise ValueError(f"caption {i} must be a string without NUL characters, got {text!r}")
        data += text.encode("utf-8") + b"\0"
    return torch.tensor(list(data), dtype=dtype, device=device)


def _concatenated(state: list | torch.Tensor) -> torch.Tensor:
    """A list state as one 1-D tensor: its tensors concatenated (a DDP sync leaves one already)."""
    if isinstance(state, list) and not state:
        return torch.zeros(0)
    return dim_zero_cat(state)


def _decode(state: list | torch.Tensor) -> list[str]:
    """The texts of a state of :func:`_encode` tensors."""
    data = bytes(_concatenated(state).round().to(torch.uint8).tolist())
    return [text.decode("utf-8") for text in data.split(b"\0")[:-1]]


class CaptionScores(Metric):
    """BLEU-4 and CIDEr-D (see :func:`bleu4`, :func:`cider_d`) of generated captions.

    ``update(generated, references)``: one generated caption per image and the reference captions of
    each image. ``compute()`` returns ``{"bleu4", "cider"}`` over every image seen (by all processes
    under DDP: the texts themselves are gathered, since CIDEr-D's document frequencies need the whole
    set); both are 0 before any image.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("generated", default=[], dist_reduce_fx="cat")
        self.add_state("references", default=[], dist_reduce_fx="cat")
        self.add_state("reference_counts", default=[], dist_reduce_fx="cat")

    def update(self, generated: Sequence[str], references: Sequence[Sequence[str]]) -> None:
        _check_aligned(generated, references)  # here, where the batch is known, rather than at compute()
        self.generated.append(_encode(generated, self.dtype, self.device))
        self.references.append(_encode([r for refs in references for r in refs], self.dtype, self.device))
        counts = [len(refs) for refs in references]
        self.reference_counts.append(torch.tensor(counts, dtype=self.dtype, device=self.device))

    def compute(self) -> dict[str, torch.Tensor]:
        generated, flat = _decode(self.generated), _decode(self.references)
        references, start = [], 0
        for count in _concatenated(self.reference_counts).round().int().tolist():
            references.append(flat[start : start + count])
            start += count
        scores = {"bleu4": bleu4(generated, references), "cider": cider_d(generated, references)}
        return {name: torch.tensor(value, dtype=torch.float32) for name, value in scores.items()}


class SceneCaptionScores(Metric):
    """Fact precision and object recall of captions of SHAPES scenes (see :mod:`vlfuse.captioning.grammar`).

    ``update(generated, scenes)``: one generated caption per scene. ``compute()`` returns
    ``{"fact_precision", "object_recall"}``: true sentences over all generated sentences (a sentence
    outside the grammar is false), and objects that a true sentence is about over all objects of
    the scenes; both micro-averaged, and 0 when there is nothing to count.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        for name in ("true_sentences", "sentences", "described_objects", "objects"):
            self.add_state(name, default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, generated: Sequence[str], scenes: Sequence[Scene]) -> None:
        if len(generated) != len(scenes):
            raise ValueError(f"{len(generated)} generated captions but {len(scenes)} scenes")
        for caption, scene in zip(generated, scenes):
            true, total = fact_precision(caption, scene)
            described, objects = object_recall(caption, scene)
            self.true_sentences += true
            self.sentences += total
            self.described_objects += described
            self.objects += objects

    def compute(self) -> dict[str, torch.Tensor]:
        return {
            "fact_precision": (self.true_sentences / self.sentences.clamp(min=1)).float(),
            "object_recall": (self.described_objects / self.objects.clamp(min=1)).float(),
        }
