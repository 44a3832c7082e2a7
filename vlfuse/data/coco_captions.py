"""COCO captions in their two common layouts, read into :class:`~vlfuse.data.captions.ImageCaptions`.

- The official annotation files (``captions_train2014.json``, ``captions_val2014.json``):
  ``{"images": [{"id", "file_name", ...}], "annotations": [{"image_id", "caption", ...}]}``, several
  annotations (captions) per image; images in one folder per split.
- The Karpathy split file (``dataset_coco.json``), which re-splits the 2014 images into train,
  restval, val and test: ``{"images": [{"filepath", "filename", "split", "sentences": [{"raw",
  ...}], "cocoid", ...}]}``; an image lies at ``<image root>/<filepath>/<filename>``.

Every malformed entry is an error that names the file and the entry (``images[12]``); an image file
that does not exist is an error that names it and the entry it comes from.
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path
from typing import Any

from vlfuse.data.captions import ImageCaptions

logger = logging.getLogger(__name__)

KARPATHY_SPLITS = ("train", "restval", "val", "test")


class CaptionFormatError(ValueError):
    """A caption file or entry that does not follow its schema; the message says where."""


def _load_lists(path: Path, keys: tuple[str, ...]) -> dict[str, list]:
    """The lists under ``keys`` of the JSON object in ``path``."""
    if not path.is_file():
        raise FileNotFoundError(f"caption file not found: {path}")
    try:
        with path.open(encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as err:
        raise CaptionFormatError(f"{path}:{err.lineno}:{err.colno}: not valid JSON: {err.msg}") from None
    for key in keys:
        if not isinstance(data, dict) or not isinstance(data.get(key), list):
            raise CaptionFormatError(f"{path}: expected a JSON object with a list under {key!r}")
    return {key: data[key] for key in keys}


def _get(entry: Any, name: str, kind: type, where: str) -> Any:
    """``entry[name]``, which must be a ``kind`` (a non-empty one, for strings)."""
    if not isinstance(entry, dict):
        raise CaptionFormatError(f"{where}: expected a JSON object, got {type(entry).__name__}")
    value = entry.get(name)
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is str and not value.strip()):
        raise CaptionFormatError(f"{where}: {name!r} must be a non-empty {kind.__name__}, got {value!r}")
    return value


def _existing(path: Path, where: str) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"{where}: image file not found: {path}")
    return str(path)


def load_coco_captions(annotations_file: str | Path, image_dir: str | Path) -> list[ImageCaptions]:
    """Read an official COCO captions file: one record per image, in the order of ``images``.

    Images without any caption are left out (and counted in a warning).

    Args:
        annotations_file: ``captions_<split>.json``.
        image_dir: the folder that holds the images' ``file_name``.

    Raises:
        CaptionFormatError: a malformed file or entry, an image id given twice, a caption of an
            image that ``images`` does not list (names the file and entry).
        FileNotFoundError: the file, or an image (names it and its entry).
    """
    path, image_dir = Path(annotations_file), Path(image_dir)
    data = _load_lists(path, ("images", "annotations"))
    files: dict[int, tuple[str, str]] = {}  # image id -> (file name, where it is listed)
    for i, entry in enumerate(data["images"]):
        where = f"{path}: images[{i}]"
        image_id, file_name = _get(entry, "id", int, where), _get(entry, "file_name", str, where)
        if image_id in files:
            raise CaptionFormatError(f"{where}: image id {image_id} is listed twice")
        files[image_id] = (file_name, where)
    captions: dict[int, list[str]] = defaultdict(list)
    for i, entry in enumerate(data["annotations"]):
        where = f"{path}: annotations[{i}]"
        image_id, caption = _get(entry, "image_id", int, where), _get(entry, "caption", str, where)
        if image_id not in files:
            raise CaptionFormatError(f"{where}: image_id {image_id} is not in the file's images")
        captions[image_id].append(caption.strip())
    uncaptioned = len(files) - len(captions)
    if uncaptioned:
        logger.warning("%s: left out %d images without captions", path, uncaptioned)
    return [
        ImageCaptions(_existing(image_dir / file_name, where), captions[image_id], image_id=str(image_id))
        for image_id, (file_name, where) in files.items()
        if image_id in captions
    ]


def load_karpathy_split(split_file: str | Path, image_root: str | Path) -> dict[str, list[ImageCaptions]]:
    """Read a Karpathy split file: the records of each split (train, restval, val, test), in file order.

    A record's ``image_id`` is the entry's ``cocoid`` when it has one, else its ``filename``.

    Args:
        split_file: ``dataset_coco.json``.
        image_root: the folder under which each image lies at ``<filepath>/<filename>``.

    Raises:
        CaptionFormatError: a malformed file or entry, an unknown split, an image without
            sentences (names the file and entry).
        FileNotFoundError: the file, or an image (names it and its entry).
    """
    path, image_root = Path(split_file), Path(image_root)
    splits: dict[str, list[ImageCaptions]] = {split: [] for split in KARPATHY_SPLITS}
    for i, entry in enumerate(_load_lists(path, ("images",))["images"]):
        where = f"{path}: images[{i}]"
        split = _get(entry, "split", str, where)
        if split not in splits:
            raise CaptionFormatError(f"{where}: unknown split {split!r} (expected one of {', '.join(KARPATHY_SPLITS)})")
        sentences = _get(entry, "sentences", list, where)
        if not sentences:
            raise CaptionFormatError(f"{where}: 'sentences' is empty")
        captions = [_get(s, "raw", str, f"{where}, sentences[{j}]").strip() for j, s in enumerate(sentences)]
        filename = _get(entry, "filename", str, where)
        image = _existing(image_root / _get(entry, "filepath", str, where) / filename, where)
        cocoid = entry.get("cocoid")
        splits[split].append(ImageCaptions(image, captions, image_id=str(cocoid if cocoid is not None else filename)))
    return splits
