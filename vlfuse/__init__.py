"""vlfuse: vision-language fusion with analysable multi-head cross-attention."""

from vlfuse.layers import CrossAttention, FusionBlock, FusionStack, ProjectedContext

__all__ = ["CrossAttention", "FusionBlock", "FusionStack", "Predictor", "ProjectedContext", "VLFuseConfig", "VLFuseModel"]
__version__ = "0.1.0"

# The model and the predictor import timm, transformers and matplotlib: load them only when asked
# for, so that `import vlfuse` stays light for users of the layers alone.
_LAZY = {"Predictor": "vlfuse.predict", "VLFuseModel": "vlfuse.model", "VLFuseConfig": "vlfuse.model"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vlfuse' has no attribute {name!r}")
