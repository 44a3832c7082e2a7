"""Image loading and preprocessing, shared by training and inference (one function, no copies).

Every image file is opened lazily (:func:`open_image`: Pillow reads the header) and decoded by
:func:`decode_image`, which refuses an image of more than :data:`MAX_IMAGE_PIXELS` pixels before
decoding it, and decodes a JPEG at a reduced scale when the model reads it much smaller. An image
held as a numpy array or a torch tensor becomes the PIL image it stands for (:func:`array_to_image`).
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

ARRAY_CHANNELS = (1, 3, 4)
"""The channel counts of an image array: gray, RGB, RGBA."""

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
    (``size``: the side it will be resized to, for reduced-scale JPEG decoding). A numpy array or
    a torch tensor goes through :func:`array_to_image`.
    """
    if isinstance(source, (np.ndarray, torch.Tensor)):
        return array_to_image(source)
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


def array_to_image(array: np.ndarray | torch.Tensor) -> Image.Image:
    """The RGB PIL image that a numpy array or a torch tensor holds.

    Shapes: ``(H, W)`` gray, ``(H, W, C)`` or ``(C, H, W)`` with ``C`` 1 (gray), 3 (RGB) or 4 (RGBA,
    composited on black as for a PIL RGBA image). A 3-D numpy array is channel-last, unless only its
    first dimension is 1, 3 or 4 (``(3, 224, 224)``); a torch tensor is channel-first (torchvision's
    ``(3, H, W)``), unless only its last dimension is 1, 3 or 4. Values: ``uint8`` 0-255, float
    ``[0, 1]`` (rounded to the nearest 1/255, as a PIL image holds it) or bool (False black, True
    white).

    Raises:
        ImageLoadError: one line naming the shape and dtype, for any other shape, channel count or
            dtype, for NaN or infinite values, and for floats outside ``[0, 1]`` (with the range found).
    """
    kind = "tensor" if isinstance(array, torch.Tensor) else "array"
    what = f"image {kind} of shape {tuple(array.shape)} and dtype {str(array.dtype).removeprefix('torch.')}"
    pixels = _as_numpy(array)
    hwc = _channel_last(pixels, channel_first=isinstance(array, torch.Tensor), what=what)  # (H, W, C)
    image = _as_uint8(hwc, what)
    return to_rgb(Image.fromarray(np.ascontiguousarray(image[:, :, 0] if image.shape[2] == 1 else image)))


def _as_numpy(array: np.ndarray | torch.Tensor) -> np.ndarray:
    """``array`` as a numpy array; a tensor's half-precision floats (no numpy bfloat16) as float32."""
    if not isinstance(array, torch.Tensor):
        return array
    tensor = array.detach().cpu()
    if tensor.is_floating_point() and tensor.dtype not in (torch.float32, torch.float64):
        tensor = tensor.float()
    return tensor.numpy()


def _channel_last(pixels: np.ndarray, channel_first: bool, what: str) -> np.ndarray:
    """``pixels`` as ``(H, W, C)`` by :func:`array_to_image`'s rule (``channel_first``: a tensor's preference)."""
    shape = pixels.shape
    if pixels.ndim == 2:
        hwc = pixels[:, :, None]  # (H, W) -> (H, W, 1)
    elif pixels.ndim == 3 and shape[0] in ARRAY_CHANNELS and (channel_first or shape[2] not in ARRAY_CHANNELS):
        hwc = pixels.transpose(1, 2, 0)  # (C, H, W) -> (H, W, C)
    elif pixels.ndim == 3 and shape[2] in ARRAY_CHANNELS:
        hwc = pixels
    else:
        raise ImageLoadError(f"{what}: expected (H, W), (H, W, C) or (C, H, W) with C = 1, 3 or 4 channels")
    if 0 in hwc.shape:
        raise ImageLoadError(f"{what}: the image has no pixels")
    return hwc


def _as_uint8(pixels: np.ndarray, what: str) -> np.ndarray:
    """uint8 ``pixels`` as they are; bool as 0 or 255; floats in [0, 1] times 255, rounded."""
    if pixels.dtype == np.uint8:
        return pixels
    if pixels.dtype == np.bool_:
        return pixels.astype(np.uint8) * 255
    if not np.issubdtype(pixels.dtype, np.floating):
        raise ImageLoadError(f"{what}: pixels must be uint8 (0-255), float in [0, 1] or bool")
    values = pixels.astype(np.float64)
    if not np.isfinite(values).all():
        raise ImageLoadError(f"{what}: has NaN or infinite values")
    low, high = float(values.min()), float(values.max())
    if low < 0.0 or high > 1.0:
        raise ImageLoadError(f"{what}: float pixels must be in [0, 1], found values in [{low:g}, {high:g}]")
    return (values * 255.0 + 0.5).astype(np.uint8)


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


INTERPOLATIONS = ("bilinear", "bicubic", "nearest")
"""How :func:`preprocess_image` can resize: the modes of timm's pretrained configs that resize
deterministically (timm's ``random`` is a training augmentation)."""


def check_interpolation(interpolation: str, name: str = "interpolation") -> str:
    """``interpolation`` if it is one of :data:`INTERPOLATIONS`, else a ``ValueError`` naming ``name``."""
    if interpolation not in INTERPOLATIONS:
        raise ValueError(f"{name} must be one of {', '.join(INTERPOLATIONS)}, got {interpolation!r}")
    return interpolation


def preprocess_image(source: ImageSource, size: int, interpolation: str = "bilinear") -> torch.Tensor:
    """Load ``source`` and return a float tensor (3, size, size) in [0, 1].

    The whole image is resized to the square (no crop: a question may be about any part of it), by
    ``interpolation`` (one of :data:`INTERPOLATIONS`; bilinear and bicubic with antialiasing, bicubic
    clipped to [0, 1]). Normalisation belongs to the model, which knows the statistics its image
    encoder expects.
    """
    check_interpolation(interpolation)
    img = load_image(source, size)
    pixels = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)  # (3, H, W)
    pixels = pixels.float().div_(255.0)
    if pixels.shape[1:] != (size, size):
        smooth = interpolation != "nearest"
        options = {"antialias": True, "align_corners": False} if smooth else {}
        pixels = F.interpolate(pixels[None], size=(size, size), mode=interpolation, **options)[0]
        if interpolation == "bicubic":
            pixels = pixels.clamp_(0.0, 1.0)  # the cubic kernel overshoots at edges
    return pixels
