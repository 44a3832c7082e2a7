"""vlfuse: vision-language fusion with analysable multi-head cross-attention."""

__all__ = [
    "Captioner",
    "CrossAttention",
    "FusionBlock",
    "FusionStack",
    "Predictor",
    "ProjectedContext",
    "SelfAttention",
    "VLFuseConfig",
    "VLFuseModel",
    "VLFuseProcessor",
]
__version__ = "0.1.0"

# Every public name imports torch, and the model and the predictor timm, transformers and
# matplotlib: each is loaded on first use, so that `import vlfuse` and `vlfuse --help` are instant.
_LAZY = {
    "CrossAttention": "vlfuse.layers",
    "FusionBlock": "vlfuse.layers",
    "FusionStack": "vlfuse.layers",
    "ProjectedContext": "vlfuse.layers",
    "SelfAttention": "vlfuse.layers",
    "Captioner": "vlfuse.inference",
    "Predictor": "vlfuse.inference",
    "VLFuseProcessor": "vlfuse.processor",
    "VLFuseModel": "vlfuse.model",
    "VLFuseConfig": "vlfuse.model",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'vlfuse' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
