"""Image loading and preprocessing, shared by training and inference (one function, no copies).

Every image file is opened lazily (:func:`open_image`: Pillow reads the header) and decoded by
:func:`decode_image`, which refuses an image of more than :data:`MAX_IMAGE_PIXELS` pixels before
decoding it, and decodes a JPEG at a reduced scale when the model reads it much smaller.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import IO

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFile, ImageOps

from vlfuse.data.records import ImageSource

MAX_IMAGE_PIXELS = 40_000_000
"""The most pixels (width x height, after any reduced-scale JPEG decoding) an image may have: a
larger one is refused before it is decoded. Read at each call: set
``vlfuse.data.transforms.MAX_IMAGE_PIXELS`` to change it (Pillow's own ``Image.MAX_IMAGE_PIXELS``,
about 89 MP, no longer decides; twice it stays Pillow's hard limit)."""

DRAFT_MARGIN = 2
"""A JPEG is decoded at 1/2, 1/4 or 1/8 scale only while both sides stay at least this many times
the side the image is resized to."""


class ImageLoadError(ValueError):
    """An image that cannot be read; the message names the file."""


def open_image(file: str | Path | IO[bytes], name: str) -> ImageFile.ImageFile:
    """Open an image without decoding it (Pillow reads the header); :func:`decode_image` decodes it.

    Pillow's decompression-bomb warning is silenced here only: :func:`decode_image` refuses every
    image over :data:`MAX_IMAGE_PIXELS` (by default half the warning's 89 MP) before decoding it.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            return Image.open(file)
    except Image.DecompressionBombError as err:
        raise ImageLoadError(f"{name} is too large to decode: {err}") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise ImageLoadError(f"cannot read image {name}: {err}") from err


def decode_image(img: ImageFile.ImageFile, name: str, size: int | None = None) -> Image.Image:
    """Decode an image opened by :func:`open_image`, upright (EXIF orientation applied).

    Args:
        img: the opened, not yet decoded image.
        name: how messages name it (its path).
        size: the side it will be resized to; a JPEG then decodes at the smallest scale that keeps
            both sides at least ``DRAFT_MARGIN * size``. ``None`` decodes it at full size.

    Raises:
        ImageLoadError: over :data:`MAX_IMAGE_PIXELS` (before decoding), or unreadable.
    """
    if size is not None:
        img.draft(img.mode, (DRAFT_MARGIN * size, DRAFT_MARGIN * size))  # JPEG only; others ignore it
    width, height = img.size
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageLoadError(
            f"{name} is {width}x{height} pixels ({width * height / 1e6:.1f} MP), over the limit of "
            f"{MAX_IMAGE_PIXELS / 1e6:g} MP (vlfuse.data.transforms.MAX_IMAGE_PIXELS)"
        )
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)  # e.g. a GIF frame larger than the image
            img.load()
    except (Image.DecompressionBombWarning, Image.DecompressionBombError) as err:
        raise ImageLoadError(f"{name} is too large to decode: {err}") from None
    except (OSError, SyntaxError, ValueError) as err:
        raise ImageLoadError(f"cannot read image {name}: {err}") from err
    return ImageOps.exif_transpose(img) or img


def load_image(source: ImageSource, size: int | None = None) -> Image.Image:
    """Return ``source`` as an RGB PIL image (paths are opened; any mode Pillow reads is converted).

    A file, or a PIL image opened from one and not decoded yet, goes through :func:`decode_image`
    (``size``: the side it will be resized to, for reduced-scale JPEG decoding).
    """
    if isinstance(source, np.ndarray):
        if source.dtype != np.uint8 or source.ndim != 3 or source.shape[-1] != 3:
            raise ImageLoadError(f"array images must be uint8 (H, W, 3) RGB, got {source.dtype} {source.shape}")
        return Image.fromarray(source, mode="RGB")
    if isinstance(source, ImageFile.ImageFile) and source.tile:  # opened, not decoded
        return to_rgb(decode_image(source, source.filename or "the image", size))
    if isinstance(source, Image.Image):
        return to_rgb(source)
    path = Path(source)
    if path.is_dir():
        raise ImageLoadError(f"{path} is a directory, not an image file")
    if not path.is_file():
        raise ImageLoadError(f"image file not found: {path}")
    with open_image(path, str(path)) as img:
        return to_rgb(decode_image(img, str(path), size))


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
    img = load_image(source, size)
    pixels = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)  # (3, H, W)
    pixels = pixels.float().div_(255.0)
    if pixels.shape[1:] != (size, size):
        pixels = F.interpolate(pixels[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]
    return pixels
