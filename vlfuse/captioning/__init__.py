"""Captioning: a causal cross-attention decoder that describes images, its generation, data and metrics.

The Lightning module is :mod:`vlfuse.captioning.lit` and the datamodules are
:mod:`vlfuse.datamodules.captions` (not imported here: they import this package).
"""

from vlfuse.heads.caption_decoder import CaptionBlock, CaptionDecoder, DecoderCache
from vlfuse.captioning.generate import Caption, beam_search, greedy
from vlfuse.captioning.grammar import Sentence, describe, fact_precision, object_recall, parse_caption
from vlfuse.captioning.metrics import CaptionScores, SceneCaptionScores, bleu4, cider_d, tokenize_caption
from vlfuse.captioning.model import CaptionConfig, CaptionModel

__all__ = [
    "Caption",
    "CaptionBlock",
    "CaptionConfig",
    "CaptionDecoder",
    "CaptionModel",
    "CaptionScores",
    "DecoderCache",
    "SceneCaptionScores",
    "Sentence",
    "beam_search",
    "bleu4",
    "cider_d",
    "describe",
    "fact_precision",
    "greedy",
    "object_recall",
    "parse_caption",
    "tokenize_caption",
]
