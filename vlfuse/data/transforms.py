"""Image loading and preprocessing, shared by training and inference (one function, no copies)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageOps

from vlfuse.data.records import ImageSource


class ImageLoadError(ValueError):
    """An image that cannot be read; the message names the file."""


def load_image(source: ImageSource) -> Image.Image:
    """Return ``source`` as an RGB PIL image (paths are opened; any mode Pillow reads is converted)."""
    if isinstance(source, np.ndarray):
        if source.dtype != np.uint8 or source.ndim != 3 or source.shape[-1] != 3:
            raise ImageLoadError(f"array images must be uint8 (H, W, 3) RGB, got {source.dtype} {source.shape}")
        return Image.fromarray(source, mode="RGB")
    if isinstance(source, Image.Image):
        return to_rgb(source)
    path = Path(source)
    if path.is_dir():
        raise ImageLoadError(f"{path} is a directory, not an image file")
    if not path.is_file():
        raise ImageLoadError(f"image file not found: {path}")
    try:
        with Image.open(path) as img:
            img.load()
            return to_rgb(ImageOps.exif_transpose(img) or img)
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as err:
        raise ImageLoadError(f"cannot read image {path}: {err}") from err


def to_rgb(img: Image.Image) -> Image.Image:
    """Convert any Pillow mode to RGB: 16-bit and float images are rescaled, alpha goes on black."""
    if img.mode in ("I;16", "I;16B", "I;16L", "I", "F"):
        array = np.asarray(img, dtype=np.float64)
        top = 65535.0 if img.mode.startswith("I;16") else max(float(array.max()), 1.0)
        img = Image.fromarray(np.clip(array / top * 255.0 + 0.5, 0, 255).astype(np.uint8), mode="L")
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return img.convert("RGB")


def preprocess_image(source: ImageSource, size: int) -> torch.Tensor:
    """Load ``source`` and return a float tensor (3, size, size) in [0, 1].

    Resizing is bilinear with antialiasing; normalisation belongs to the model, which knows the
    statistics its image encoder expects.
    """
    img = load_image(source)
    pixels = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)  # (3, H, W)
    pixels = pixels.float().div_(255.0)
    if pixels.shape[1:] != (size, size):
        pixels = F.interpolate(pixels[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
    return pixels
