"""Captioning: a decoder that describes images, its data and its metrics."""

# --- data and metrics (helper capdata): grammar.py, metrics.py ---------------------------------
from vlfuse.captioning.grammar import Sentence, describe, fact_precision, object_recall, parse_caption
from vlfuse.captioning.metrics import CaptionScores, SceneCaptionScores, bleu4, cider_d, tokenize_caption

__all__ = [
    "CaptionScores",
    "SceneCaptionScores",
    "Sentence",
    "bleu4",
    "cider_d",
    "describe",
    "fact_precision",
    "object_recall",
    "parse_caption",
    "tokenize_caption",
]
# --- end of data and metrics -------------------------------------------------------------------
