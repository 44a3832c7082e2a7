"""vlfuse: vision-language fusion with analysable multi-head cross-attention."""

from vlfuse.layers import CrossAttention, FusionBlock, FusionStack, ProjectedContext

__all__ = ["CrossAttention", "FusionBlock", "FusionStack", "ProjectedContext"]
__version__ = "0.1.0"
