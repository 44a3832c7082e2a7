"""Heads: interchangeable parts that turn the fuser's output into answer scores, one file each.

Select one by type in the model config (``head: {type: pooled}``); add one by registering its
config class with ``@HEADS.register``. The caption decoder (:mod:`vlfuse.heads.caption_decoder`)
writes words instead of scoring answers, for :class:`~vlfuse.captioning.CaptionModel`.
"""

from vlfuse.heads.base import HEADS, Head, HeadConfig
from vlfuse.heads.bilinear import BilinearConfig, BilinearHead, QuadraticForms
from vlfuse.heads.existence import ExistenceConfig, ExistenceHead
from vlfuse.heads.pooled import PooledConfig, PooledHead, masked_mean

__all__ = [
    "HEADS",
    "BilinearConfig",
    "BilinearHead",
    "ExistenceConfig",
    "ExistenceHead",
    "Head",
    "HeadConfig",
    "PooledConfig",
    "PooledHead",
    "QuadraticForms",
    "masked_mean",
]
