"""Captioning: a causal cross-attention decoder that describes images, its generation and training."""

# ---- capmodel: the caption model and generation (the Lightning module is vlfuse.captioning.lit)
from vlfuse.captioning.decoder import CaptionBlock, CaptionDecoder, DecoderCache
from vlfuse.captioning.generate import Caption, beam_search, greedy
from vlfuse.captioning.model import CaptionConfig, CaptionModel

__all__ = [
    "Caption",
    "CaptionBlock",
    "CaptionConfig",
    "CaptionDecoder",
    "CaptionModel",
    "DecoderCache",
    "beam_search",
    "greedy",
]
