"""Image and text encoder wrappers (timm, transformers) and tokenizers."""

from vlfuse.encoders.cache import FeatureCache, TokenCache
from vlfuse.encoders.image import ImageEncoder, ImageEncoderConfig
from vlfuse.encoders.saved_text_config import saved_text_config
from vlfuse.encoders.text import TextEncoder, TextEncoderConfig, scratch_config
from vlfuse.encoders.tokenizer import build_word_tokenizer, load_saved_tokenizer, load_tokenizer, word_tokenizer_from_json

__all__ = [
    "FeatureCache",
    "ImageEncoder",
    "ImageEncoderConfig",
    "TextEncoder",
    "TextEncoderConfig",
    "TokenCache",
    "build_word_tokenizer",
    "load_saved_tokenizer",
    "load_tokenizer",
    "saved_text_config",
    "scratch_config",
    "word_tokenizer_from_json",
]
