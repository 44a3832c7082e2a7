"""VQA data as streaming shards: Lightning's ``litdata`` optimized chunks, one item per image.

A shard folder holds one litdata dataset per split (``train/``, ``val/``, ``test/``: each an
``index.json`` and ``chunk-*.bin`` files written by ``litdata.optimize``) and, beside them,
:data:`INDEX_NAME`: the answer vocabulary, the training questions (for a word-level tokenizer) and
each split's counts. An item is one image as its file stores it (PNG or JPEG bytes, not decoded
pixels) with all its questions and answers:

- ``image``: the encoded image (``bytes``);
- ``meta``: a JSON object: ``name``, what messages call the image (its file name, or the record's
  image id); ``key``, the source image's :func:`~vlfuse.data.dataset.image_key` (its absolute path
  at conversion, ``""`` for an image held in memory), the key of a frozen encoder's feature cache;
  ``questions``, ``answers`` and, where the data has them, ``human_answers`` (every annotator's).

Everything but the image is one JSON string: litdata stores a string field that names an existing
image file as that file's content, which a file name or a path would be.

Reading trusts nothing in the folder: only the ``bytes`` and ``str`` serializers of litdata are
allowed (every other one, pickle among them, is refused before it reads a byte), every field is
type-checked, and images are decoded by :func:`~vlfuse.data.transforms.preprocess_image` with its
pixel limit, exactly as the image files are.

This module imports ``litdata`` (``pip install 'vlfuse[stream]'``); nothing else in
:mod:`vlfuse.data` imports it.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import litdata
import torch
from litdata.streaming.downloader import get_downloader
from litdata.streaming.serializers import _SERIALIZERS, Serializer
from torch.utils.data import Dataset

from vlfuse.data.answers import AnswerVocab
from vlfuse.data.dataset import grouped_item, image_key
from vlfuse.data.records import ImageQuestions
from vlfuse.data.transforms import check_interpolation, decode_image, load_image, open_image, preprocess_image

INDEX_NAME = "vlfuse_shards.json"
"""The file beside the split folders: vocabulary, training questions, counts."""
FORMAT = "vlfuse-shards/1"
FIELDS = {"image": (bytes, memoryview), "meta": str}
"""Every item's fields and the types they are read as (litdata reads bytes as a memoryview): nothing else is read."""
ALLOWED_SERIALIZERS = ("bytes", "str")
DEFAULT_CHUNK_BYTES = "64MB"
REMOTE_PREFIXES = ("s3://", "gs://", "azure://", "r2://", "hf://", "local:")
"""The object-store URLs litdata streams from (``local:`` is a local folder read as if it were one)."""


# ------------------------------------------------------------------------------------------ writing
def shard_item(record: ImageQuestions) -> dict[str, Any]:
    """``record`` as one item: its image file's bytes as stored (an image held in memory: its RGB
    pixels as PNG, lossless), its name and key, and its questions and answers as JSON."""
    source = record.image
    if isinstance(source, (str, Path)):
        data, name = Path(source).read_bytes(), Path(source).name
    else:
        buffer = io.BytesIO()
        load_image(source).save(buffer, format="PNG")  # the RGB image the folder's dataset would read
        data, name = buffer.getvalue(), record.image_id or "an image in memory"
    meta = {
        "name": record.image_id or name,
        "key": image_key(source) or "",
        "questions": list(record.questions),
        "answers": list(record.answers),
    }
    if record.human_answers:
        meta["human_answers"] = [list(h) for h in record.human_answers]
    return {"image": data, "meta": json.dumps(meta)}


def _check_written(folder: Path) -> None:
    """That litdata stored the fields as :data:`FIELDS` says (it picks a serializer by each value)."""
    config = json.loads((folder / "index.json").read_text())["config"]
    if config.get("data_format") != ["bytes", "str"] or config.get("item_loader") != "PyTreeLoader":
        raise ValueError(f"{folder}: litdata wrote the fields as {config.get('data_format')}, not ['bytes', 'str']")


def _index_entry(records: Sequence[ImageQuestions]) -> dict[str, Any]:
    answers = Counter(a for r in records for a in r.answers)
    return {"images": len(records), "questions": sum(len(r.questions) for r in records), "answers": dict(answers)}


def write_shards(
    splits: Mapping[str, Sequence[ImageQuestions]],
    answers: Sequence[str],
    out: str | Path,
    *,
    source: str,
    chunk_bytes: str | int = DEFAULT_CHUNK_BYTES,
    workers: int = 1,
    report: Callable[[str], None] = print,
) -> Path:
    """Write ``splits`` (``{"train": records, "val": ..., "test": ...}``) as shards into the new folder
    ``out`` with ``litdata.optimize``: into a staging folder beside it, renamed to ``out`` once
    every split and the index are written, so that ``out`` is whole or absent.

    Args:
        splits: each split's records (each image once, with all its questions).
        answers: the answer vocabulary (the source datamodule's ``data_vocab``).
        out: the folder to create; an existing one is refused.
        source: what the data was converted from, recorded in the index.
        chunk_bytes: litdata's chunk size (``"64MB"``, or a number of bytes).
        workers: ``litdata.optimize`` worker processes; with one, a split's items are in record order.
        report: where each split's progress line goes (litdata draws its own progress bar too).

    Raises:
        FileExistsError: ``out`` exists.
        ValueError: no split, or an empty one.
    """
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"--out {out} exists: give a new folder (vlfuse convert never overwrites one)")
    if not splits or "train" not in splits:
        raise ValueError("the data has no training split to convert")
    for split, records in splits.items():
        if not records:
            raise ValueError(f"the {split} split has no images to convert")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = out.parent / f".{out.name}.staging-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for split, records in splits.items():
            entry = _index_entry(records)
            report(f"vlfuse: converting the {split} split: {entry['images']:,} images, {entry['questions']:,} questions")
            litdata.optimize(
                fn=shard_item,
                inputs=list(records),
                output_dir=str((staging / split).absolute()),
                chunk_bytes=chunk_bytes,
                num_workers=workers,
                reorder_files=False,
                keep_data_ordered=True,
                start_method="fork",
                verbose=True,
            )
            _check_written(staging / split)
        questions = Counter(q for r in splits["train"] for q in r.questions)
        index = {
            "format": FORMAT,
            "source": source,
            "litdata": litdata.__version__,
            "answers": list(answers),
            "train_questions": [[q, n] for q, n in questions.items()],
            "splits": {split: _index_entry(records) for split, records in splits.items()},
        }
        (staging / INDEX_NAME).write_text(json.dumps(index, indent=1))
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    try:
        os.rename(staging, out)  # refused if out appeared meanwhile and holds anything
    except OSError as err:
        raise FileExistsError(f"--out {out} appeared while converting ({err.strerror}): the shards are in {staging}") from None
    return out


# ------------------------------------------------------------------------------------------ reading
class _Refused(Serializer):
    """A litdata serializer that no shard of vlfuse uses: reading a field stored with it stops the run."""

    def __init__(self, name: str) -> None:
        self.name = name

    def serialize(self, item: Any) -> tuple[bytes, str | None]:
        raise ValueError(f"vlfuse shards store no {self.name!r} field")

    def deserialize(self, data: bytes) -> Any:
        raise ValueError(
            f"the shards hold a field stored with litdata's {self.name!r} serializer; vlfuse shards hold only "
            f"{', '.join(ALLOWED_SERIALIZERS)} fields (written by vlfuse convert), and refuses to deserialise others"
        )

    def can_serialize(self, item: Any) -> bool:
        return False


def safe_serializers() -> dict[str, Serializer]:
    """litdata's serializers with every one but ``bytes`` and ``str`` refused (pickle, tensors, images...)."""
    return {name: _Refused(name) for name in _SERIALIZERS if name not in ALLOWED_SERIALIZERS}


def is_remote(data_dir: str) -> bool:
    """Whether ``data_dir`` is an object-store URL (``s3://...``) rather than a local folder."""
    return str(data_dir).startswith(REMOTE_PREFIXES)


def _split_location(data_dir: str, split: str) -> str:
    return f"{str(data_dir).rstrip('/')}/{split}" if is_remote(data_dir) else str(Path(data_dir) / split)


def read_index(data_dir: str, cache_dir: str | None = None, storage_options: dict | None = None) -> dict[str, Any]:
    """The checked :data:`INDEX_NAME` of the shard folder or URL ``data_dir`` (a URL's is downloaded
    into ``cache_dir``).

    Raises:
        FileNotFoundError: no index there.
        ValueError: it is not a vlfuse shard index, or a field has the wrong type; the message names the file.
    """
    if is_remote(data_dir):
        if cache_dir is None:
            raise ValueError(f"data_dir {data_dir} is a URL: give data.init_args.cache_dir, a local folder for its chunks")
        local = Path(cache_dir) / INDEX_NAME
        local.parent.mkdir(parents=True, exist_ok=True)
        location = f"{str(data_dir).rstrip('/')}/{INDEX_NAME}"
        get_downloader(str(data_dir), str(cache_dir), [], storage_options or {}).download_file(location, str(local))
    else:
        local = location = Path(data_dir) / INDEX_NAME
        if not Path(data_dir).is_dir():
            raise FileNotFoundError(f"data_dir {data_dir} is not a folder (vlfuse convert writes one)")
        if not local.is_file():
            raise FileNotFoundError(f"{location} not found: {data_dir} is not a shard folder written by vlfuse convert")
    try:
        index = json.loads(Path(local).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{location}: cannot read the shard index: {err}") from None
    _check_index(index, str(location))
    return index


def _check_index(index: Any, where: str) -> None:
    def bad(what: str) -> ValueError:
        return ValueError(f"{where}: not a vlfuse shard index: {what}")

    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise bad(f"expected format {FORMAT!r}")
    if not _str_list(index.get("answers")) or not index["answers"]:
        raise bad("answers must be a non-empty list of strings")
    pairs = index.get("train_questions")
    if not isinstance(pairs, list) or not all(
        isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) and type(p[1]) is int and p[1] > 0 for p in pairs
    ):
        raise bad("train_questions must be a list of [question, count] pairs")
    splits = index.get("splits")
    if not isinstance(splits, dict) or "train" not in splits:
        raise bad("splits must name the train split")
    for split, entry in splits.items():
        if split not in ("train", "val", "test"):
            raise bad(f"unknown split {split!r}")
        if not (
            isinstance(entry, dict)
            and all(type(entry.get(k)) is int and entry[k] > 0 for k in ("images", "questions"))
            and isinstance(entry.get("answers"), dict)
            and all(isinstance(a, str) and type(n) is int and n > 0 for a, n in entry["answers"].items())
        ):
            raise bad(f"split {split!r} must give images and questions (counts) and answers ({{answer: count}})")


def _str_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


class ShardDecoder:
    """Turns a shard item into a :class:`~vlfuse.data.GroupedVQADataset` item: the image decoded and
    resized exactly as from its file (:func:`~vlfuse.data.transforms.preprocess_image`), its
    questions labelled with ``vocab``. Every field is type-checked; a bad one is a ``ValueError``
    naming ``where`` and the item.

    Args:
        vocab: the vocabulary that labels the answers (outside it: ``IGNORE_INDEX``).
        image_size: side of the square image tensor.
        interpolation: how images are resized (see ``preprocess_image``).
        where: the split's location, for messages.
    """

    def __init__(self, vocab: AnswerVocab, image_size: int, interpolation: str, where: str) -> None:
        self.vocab = vocab
        self.image_size = image_size
        self.interpolation = check_interpolation(interpolation)
        self.where = where

    def record(self, item: Any) -> tuple[ImageQuestions, bytes, str]:
        """The item's questions and answers (with no image), its encoded image and its key."""
        if not isinstance(item, dict) or set(item) != set(FIELDS) or not all(isinstance(item[f], k) for f, k in FIELDS.items()):
            raise ValueError(f"{self.where}: an item is not a vlfuse shard item (fields image: bytes, meta: str)")
        try:
            meta = json.loads(item["meta"])
        except json.JSONDecodeError as err:
            raise ValueError(f"{self.where}: an item's meta is not JSON: {err}") from None
        if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
            raise ValueError(f"{self.where}: an item's meta is not an object with a name")
        name = meta["name"]
        human = meta.get("human_answers", [])
        if not (
            set(meta) <= {"name", "key", "questions", "answers", "human_answers"}
            and isinstance(meta.get("key"), str)
            and _str_list(meta.get("questions"))
            and meta["questions"]
            and _str_list(meta.get("answers"))
            and isinstance(human, list)
            and all(_str_list(h) for h in human)
        ):
            raise ValueError(f"{self.where}: item {name!r}: needs a key and a non-empty list of questions, with answers (strings)")
        try:
            record = ImageQuestions(name, meta["questions"], meta["answers"], image_id=name, human_answers=human)
        except ValueError as err:
            raise ValueError(f"{self.where}: {err}") from None
        return record, bytes(item["image"]), meta["key"]

    def pixels(self, data: bytes, name: str) -> torch.Tensor:
        """The encoded image ``data`` as ``(3, S, S)`` in [0, 1], as :func:`preprocess_image` makes it of a file."""
        label = f"{self.where}: {name}"
        image = decode_image(open_image(io.BytesIO(data), label), label, self.image_size)
        return preprocess_image(image, self.image_size, self.interpolation)

    def __call__(self, item: Any) -> dict:
        record, data, key = self.record(item)
        return grouped_item(record, self.vocab, key or None, self.pixels(data, record.image_id))


def open_split(
    data_dir: str,
    split: str,
    transform: Callable[[Any], Any] | None,
    *,
    seed: int = 0,
    limit: int | None = None,
    size: int | None = None,
    cache_dir: str | None = None,
    storage_options: dict | None = None,
) -> litdata.StreamingDataset:
    """``split`` of the shards at ``data_dir`` as a litdata ``StreamingDataset`` reading only
    ``bytes`` and ``str`` fields (:func:`safe_serializers`), each item passed through ``transform``.

    It is opened unshuffled; ``StreamingDataLoader(..., shuffle=True)`` shuffles it with ``seed``:
    the order of the chunks, and a whole permutation of each chunk's items.
    ``limit`` keeps the split's first ``limit`` of its ``size`` images (litdata's ``subsample``,
    taken before any shuffling). Its distributed share is litdata's: the world size and rank of
    ``torch.distributed`` when it is initialised (as under a DDP trainer), else ``WORLD_SIZE`` and
    ``GLOBAL_RANK`` from the environment.
    """
    location = _split_location(data_dir, split)
    if not is_remote(data_dir) and not (Path(location) / "index.json").is_file():
        raise FileNotFoundError(f"{location}/index.json not found: the shards of {data_dir} have no {split} split")
    fraction = 1.0 if limit is None or size is None or limit >= size else (limit + 0.5) / size  # litdata floors
    return litdata.StreamingDataset(
        location,
        cache_dir=None if cache_dir is None else str(Path(cache_dir) / split),
        shuffle=False,
        seed=seed,
        subsample=fraction,
        # Shuffled, a chunk's items in any order (litdata's default: within blocks of 256 items), each
        # item deserialised alone: with windows of items decoded together, a whole permutation reads
        # a window per item (an epoch of 20,000 small items took 25-35 s instead of 0.5 s).
        item_shuffle_window="full",
        batch_decode=0,
        serializers=safe_serializers(),
        storage_options=storage_options or {},
        transform=transform,
    )


class ShardSplit(Dataset):
    """A split of the shards read in order by index (random access into litdata's chunks), for
    evaluation: a map-style dataset, so that under DDP each process takes its share of the images
    with Lightning's ``UnrepeatedDistributedSampler``, every image once.

    Args:
        stream: the split as :func:`open_split` opens it (not shuffled).
        size: its number of images (from the shard index).
    """

    def __init__(self, stream: litdata.StreamingDataset, size: int) -> None:
        self.stream = stream
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.size:
            raise IndexError(f"item {i} of a split of {self.size} images")
        return self.stream[i]
