"""Attention and fusion layers: plain torch, no data, no encoders, no Lightning."""

from vlfuse.layers.attention import CrossAttention, ProjectedContext, attention_core
from vlfuse.layers.fusion import FusionBlock, FusionStack

__all__ = ["CrossAttention", "FusionBlock", "FusionStack", "ProjectedContext", "attention_core"]
