"""A frozen image encoder's outputs on disk: safetensors shards and a JSON index, written once by
``vlfuse cache-features`` (:class:`FeatureStoreWriter`) and read while a model trains
(:class:`DiskFeatureStore`).

A store is a folder::

    index.json                  format, the encoder's identity, dtype, feature shape, the shards
                                (file, rows, size, sha256) and each image key's [shard, row]
    shard-00000.safetensors     one tensor "features" (rows, tokens, width)
    shard-00001.safetensors     ...

Every file is written beside its target, flushed to disk and renamed onto it (:mod:`vlfuse.atomic`):
a writer killed at any point leaves the index of the shards finished before, and a rerun writes only
the images that index lacks. The index and the shards are read as untrusted data: sizes, dtypes and
shapes are checked against each other and against the files before anything is allocated, and
nothing is unpickled.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import struct
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
from safetensors.torch import save_file

from vlfuse import atomic
from vlfuse.model_io import sha256
from vlfuse.json_input import JSONInputError, parse_json

INDEX_FILE = "index.json"
"""The store's index, beside its shards."""
STORE_FORMAT = "vlfuse-features"
"""The ``format`` of a store's index."""
STORE_VERSION = 1
"""The version of the store format this code writes and reads."""
TENSOR = "features"
"""The name of the one tensor of each shard."""
STAGING = ".partial-"
"""Marks a file being written, ``.<name>.partial-<pid>-<random>``, beside its target."""
LOCK_FILE = ".lock"
"""Held (``flock``) by the one writer of a store."""
SHARD_NAME = re.compile(r"shard-\d{5}\.safetensors")
"""The names of shards: nothing else (no path) is opened from an index."""
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
"""The dtypes a store may hold, by name."""
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}
"""The safetensors header's name of each dtype."""
MAX_INDEX_BYTES = 256 << 20
"""The largest index read (256 MiB: about 2 million image paths)."""
MAX_HEADER_BYTES = 1 << 20
"""The largest safetensors header read from a shard (it holds one tensor's entry)."""
MAX_TOKENS = 1 << 20
"""The most tokens per image an index may declare."""
MAX_WIDTH = 1 << 16
"""The widest feature an index may declare."""
DEFAULT_SHARD_BYTES = 1 << 30
"""Shards hold as many images as fit in 1 GiB, unless told otherwise (a shard is built in memory)."""


def dtype_name(dtype: torch.dtype) -> str:
    """The store's name of a torch dtype (a ``ValueError`` for one a store cannot hold)."""
    for name, value in DTYPES.items():
        if value == dtype:
            return name
    raise ValueError(f"a feature store holds {', '.join(DTYPES)}, not {dtype}")


def weights_digest(module: torch.nn.Module) -> str:
    """SHA-256 of ``module``'s state (every tensor's name, dtype, shape and bytes, by name): two encoders
    give the same features from the same pixels when their digests and preprocessing agree."""
    digest = hashlib.sha256()
    for name, tensor in sorted(module.state_dict().items()):
        data = tensor.detach().contiguous().cpu()
        digest.update(f"{name}:{data.dtype}:{tuple(data.shape)};".encode())
        digest.update(data.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def encoder_identity(name: str, vit: torch.nn.Module, preprocessing: Mapping[str, Any]) -> dict[str, Any]:
    """What a store's features depend on: the timm model ``name``, the digest of its weights
    (:func:`weights_digest`) and the preprocessing (``image_size``, ``mean``, ``std``, ``interpolation``)."""
    identity = {"name": name, "weights_sha256": weights_digest(vit)}
    identity.update({key: preprocessing[key] for key in ("image_size", "mean", "std", "interpolation")})
    return identity


class StoreError(ValueError):
    """A feature store that cannot be read or written: the message names the file."""


# ------------------------------------------------------------------------------ the index
def read_index(directory: Path) -> dict[str, Any]:
    """``directory/index.json``, checked to describe a store (:func:`check_index`)."""
    path = directory / INDEX_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a feature store: no {INDEX_FILE} (vlfuse cache-features writes one)")
    size = path.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise StoreError(f"{path} is {size >> 20} MiB, more than the {MAX_INDEX_BYTES >> 20} MiB an index may be")
    try:
        index = parse_json(path.read_bytes())
    except JSONInputError as err:
        raise StoreError(f"{path}: {err}") from None
    check_index(index, path)
    return index


def _require(condition: bool, path: Path, what: str) -> None:
    if not condition:
        raise StoreError(f"{path} is not a valid feature store index: {what}")


def _is_int(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def check_index(index: Any, path: Path) -> None:
    """A :class:`StoreError` naming ``path`` unless ``index`` is a store index of this version whose
    shards, rows and keys agree with each other."""
    _require(isinstance(index, dict), path, "not a JSON object")
    _require(index.get("format") == STORE_FORMAT, path, f"format is {index.get('format')!r}, not {STORE_FORMAT!r}")
    _require(index.get("version") == STORE_VERSION, path, f"version {index.get('version')!r} (this vlfuse reads {STORE_VERSION})")
    _require(isinstance(index.get("encoder"), dict), path, "no encoder identity")
    _require(index.get("dtype") in DTYPES, path, f"dtype {index.get('dtype')!r} is not one of {list(DTYPES)}")
    shape = index.get("shape")
    _require(
        isinstance(shape, list) and len(shape) == 2 and _is_int(shape[0], 1, MAX_TOKENS) and _is_int(shape[1], 1, MAX_WIDTH),
        path, f"shape {shape!r} is not [tokens, width]",
    )
    shards = index.get("shards")
    _require(isinstance(shards, list), path, "shards is not a list")
    for number, shard in enumerate(shards):
        _require(isinstance(shard, dict), path, f"shard {number} is not an object")
        _require(shard.get("file") == shard_name(number), path, f"shard {number} is named {shard.get('file')!r}, not {shard_name(number)!r}")
        _require(_is_int(shard.get("rows"), 1, 1 << 40), path, f"shard {number} has rows {shard.get('rows')!r}")
        _require(_is_int(shard.get("size"), 1, 1 << 50), path, f"shard {number} has size {shard.get('size')!r}")
        digest = shard.get("sha256")
        _require(isinstance(digest, str) and re.fullmatch(r"[0-9a-f]{64}", digest) is not None, path, f"shard {number} has no sha256")
    keys = index.get("keys")
    _require(isinstance(keys, dict), path, "keys is not an object")
    for key, place in keys.items():
        _require(
            isinstance(place, list) and len(place) == 2 and _is_int(place[0], 0, len(shards) - 1)
            and _is_int(place[1], 0, shards[place[0]]["rows"] - 1),
            path, f"image {key!r} is at {place!r}, not [shard, row] of a listed shard",
        )


def shard_name(number: int) -> str:
    """The file name of shard ``number``."""
    return f"shard-{number:05d}.safetensors"


def mismatch(stored: Mapping[str, Any], wanted: Mapping[str, Any]) -> str | None:
    """The first field of an encoder identity where ``stored`` and ``wanted`` differ, said in words; ``None`` if none."""
    for field in sorted(set(stored) | set(wanted)):
        if stored.get(field) != wanted.get(field):
            return f"{field} is {_short(stored.get(field))} there, {_short(wanted.get(field))} here"
    return None


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


# ------------------------------------------------------------------------------ reading
class StoredShard:
    """One shard file as the reader sees it: where its features start and how long a row is.

    Attributes:
        path: the file.
        rows: the images it holds.
        offset: the byte where row 0 starts (after the safetensors header).
        row_bytes: the bytes of one image's features.
    """

    def __init__(self, path: Path, rows: int, size: int, dtype: str, shape: Sequence[int]) -> None:
        self.path = path
        self.rows = rows
        itemsize = DTYPES[dtype].itemsize
        self.row_bytes = shape[0] * shape[1] * itemsize
        self.offset = check_shard(path, size, dtype, (rows, *shape))
        self._descriptor: int | None = None

    def read_row(self, row: int, out: torch.Tensor) -> None:
        """Read ``row``'s bytes into ``out`` (``(row_bytes,)`` uint8) with one ``pread``."""
        if self._descriptor is None:
            self._descriptor = os.open(self.path, os.O_RDONLY)
        got = os.preadv(self._descriptor, [out.numpy()], self.offset + row * self.row_bytes)
        if got != self.row_bytes:
            raise StoreError(f"{self.path}: row {row} ends after {got} of its {self.row_bytes} bytes: the shard was truncated")

    def __getstate__(self) -> dict[str, Any]:
        """A copy sent to another process opens the file anew there."""
        return {**self.__dict__, "_descriptor": None}

    def close(self) -> None:
        if self._descriptor is not None:
            os.close(self._descriptor)
            self._descriptor = None


def check_shard(path: Path, size: int, dtype: str, shape: Sequence[int]) -> int:
    """Check that ``path`` is a safetensors file of ``size`` bytes holding one tensor ``features`` of
    ``dtype`` and ``shape`` filling it; returns the byte offset of its data (a :class:`StoreError`
    naming the file otherwise). Reads the header only."""
    if not path.is_file():
        raise StoreError(f"{path}: the shard the index lists is missing")
    found = path.stat().st_size
    if found != size:
        raise StoreError(f"{path} is {found} bytes, the index says {size}: the shard is truncated or was replaced")
    with open(path, "rb") as file:
        prefix = file.read(8)
        length = struct.unpack("<Q", prefix)[0] if len(prefix) == 8 else -1
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise StoreError(f"{path} is not a safetensors file: its header length {length} does not fit the file")
        try:
            header = parse_json(file.read(length))
        except JSONInputError as err:
            raise StoreError(f"{path} is not a safetensors file: its header: {err}") from None
    tensors = {name: entry for name, entry in header.items() if name != "__metadata__"} if isinstance(header, dict) else None
    expected_bytes = DTYPES[dtype].itemsize
    for dim in shape:
        expected_bytes *= dim
    wanted = {TENSOR: {"dtype": SAFETENSORS_DTYPES[dtype], "shape": list(shape), "data_offsets": [0, expected_bytes]}}
    if tensors != wanted:
        raise StoreError(f"{path} does not hold the index's {TENSOR} {dtype} {list(shape)} alone: its header says {_short(tensors)}")
    offset = 8 + length
    if offset + expected_bytes != size:
        raise StoreError(f"{path}: {offset} header bytes and {expected_bytes} of features do not make its {size} bytes")
    return offset


class DiskFeatureStore:
    """A store written by ``vlfuse cache-features``, read while a model trains: the features of a
    batch's image keys, each image's row read from its shard with one ``pread``.

    Rows are read through the operating system's page cache, not mapped into the process: the pages
    are shared by every process reading the store (DDP ranks on one machine), and the reader's
    resident memory is the batch it returns, whatever the store's size (a memory map would count
    every page read as the process's own until the kernel reclaims it; ``docs/results.md``, "Features
    on disk", measures both).

    Opening checks the index and every shard's header and size (:func:`check_index`,
    :func:`check_shard`); :meth:`verify` also checks each shard's SHA-256.

    Args:
        directory: the store's folder.

    Attributes:
        encoder: the identity of the encoder that wrote it (:func:`encoder_identity`).
        dtype: the features' dtype as stored.
        shape: ``(tokens, width)`` of one image's features.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        index = read_index(self.directory)
        self.encoder: dict[str, Any] = index["encoder"]
        self.dtype_name: str = index["dtype"]
        self.dtype = DTYPES[self.dtype_name]
        self.shape = tuple(index["shape"])
        self.row_bytes = self.shape[0] * self.shape[1] * self.dtype.itemsize
        self._index = index
        self.shards = [
            StoredShard(self.directory / shard["file"], shard["rows"], shard["size"], self.dtype_name, self.shape)
            for shard in index["shards"]
        ]
        self._places: dict[str, list[int]] = index["keys"]

    def __len__(self) -> int:
        return len(self._places)

    def __contains__(self, key: object) -> bool:
        return key in self._places

    def __iter__(self) -> Iterator[str]:
        return iter(self._places)

    def place(self, key: str) -> tuple[int, int]:
        """``(shard, row)`` of ``key``'s features (a ``KeyError`` if the store lacks it)."""
        shard, row = self._places[key]
        return shard, row

    def check_encoder(self, identity: Mapping[str, Any]) -> None:
        """A ``ValueError`` naming the first field where the encoder that wrote the store and
        ``identity`` (the model's, :func:`encoder_identity`) differ."""
        different = mismatch(self.encoder, identity)
        if different is not None:
            raise StoreError(f"feature store {self.directory} holds another image encoder's features: {different}")

    def get(self, keys: Sequence[str]) -> torch.Tensor:
        """The features of ``keys`` (each in the store), ``(len(keys), tokens, width)`` in :attr:`dtype`."""
        rows = torch.empty((len(keys), self.row_bytes), dtype=torch.uint8)
        for i, key in enumerate(keys):
            place = self._places.get(key)
            if place is None:
                raise KeyError(f"image {key!r} is not in the feature store {self.directory}")
            self.shards[place[0]].read_row(place[1], rows[i])
        return rows.view(self.dtype).view(len(keys), *self.shape)  # (B, row bytes) -> (B, tokens, width)

    def verify(self) -> None:
        """Check every shard's SHA-256 against the index (reads the whole store); a :class:`StoreError` names the first that differs."""
        for shard, listed in zip(self.shards, self._index["shards"]):
            if sha256(shard.path) != listed["sha256"]:
                raise StoreError(f"{shard.path}: its SHA-256 differs from the index's: the shard is damaged")

    def close(self) -> None:
        """Close the shards' files (reading again opens them again)."""
        for shard in self.shards:
            shard.close()


# ------------------------------------------------------------------------------ writing
class FeatureStoreWriter:
    """Writes a store shard by shard, resuming one that the same encoder began.

    Opening takes the store's lock (one writer at a time), removes what killed writers left
    half-written, and reads the index if there is one: a store of another encoder, dtype or feature
    shape is refused (never overwritten), as is a folder holding anything but a store.

    Args:
        directory: the store's folder (created if missing).
        encoder: the identity of the encoder (:func:`encoder_identity`).
        dtype: what the features are stored as.
        shape: ``(tokens, width)`` of one image's features.
    """

    def __init__(self, directory: str | Path, encoder: Mapping[str, Any], dtype: torch.dtype, shape: Sequence[int]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.dtype = dtype
        self.shape = tuple(shape)
        self._lock = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._lock)
            raise StoreError(f"{self.directory}: another vlfuse cache-features is writing this store") from None
        try:
            atomic.remove_abandoned(self.directory, ".")
            self.index = self._resumed_or_new(encoder, dtype)
        except BaseException:
            self.close()
            raise

    def _resumed_or_new(self, encoder: Mapping[str, Any], dtype: torch.dtype) -> dict[str, Any]:
        """The index there, if it is of the same encoder, dtype and shape; a new one for a folder
        holding nothing but shards (left by a writer killed before its first index) and the lock."""
        fresh = {"format": STORE_FORMAT, "version": STORE_VERSION, "encoder": dict(encoder), "dtype": dtype_name(dtype),
                 "shape": list(self.shape), "shards": [], "keys": {}}
        if (self.directory / INDEX_FILE).exists():
            index = read_index(self.directory)
            different = mismatch(described(index), described(fresh))
            if different is not None:
                raise StoreError(f"{self.directory} holds another store ({different}): give another --out, or remove it")
            return index
        foreign = sorted(p.name for p in self.directory.iterdir() if p.name != LOCK_FILE and not SHARD_NAME.fullmatch(p.name))
        if foreign:
            raise StoreError(f"{self.directory} is not a feature store (it holds {', '.join(foreign[:3])}): give another --out")
        return fresh

    def __contains__(self, key: object) -> bool:
        return key in self.index["keys"]

    def __len__(self) -> int:
        return len(self.index["keys"])

    @property
    def shard_count(self) -> int:
        return len(self.index["shards"])

    def add_shard(self, keys: Sequence[str], features: torch.Tensor) -> None:
        """Write ``features`` ``(len(keys), tokens, width)`` as the next shard, then the index with its keys."""
        if features.shape != (len(keys), *self.shape) or features.dtype != self.dtype:
            raise ValueError(f"a shard of {len(keys)} images takes {self.dtype} {(len(keys), *self.shape)}, got {features.dtype} {tuple(features.shape)}")
        number = self.shard_count
        target = self.directory / shard_name(number)
        temp = self._staging(target)
        try:
            save_file({TENSOR: features.contiguous()}, str(temp), metadata={"format": "pt"})
            atomic.give_default_permissions(temp)  # readable as the index is (safetensors creates it private)
            atomic.fsync(temp)
            os.replace(temp, target)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        atomic.fsync(self.directory)
        self.index["shards"].append({"file": target.name, "rows": len(keys), "size": target.stat().st_size, "sha256": sha256(target)})
        self.index["keys"].update({key: [number, row] for row, key in enumerate(keys)})
        self._write_index()

    def _write_index(self) -> None:
        target = self.directory / INDEX_FILE
        text = json.dumps(self.index, allow_nan=False, separators=(",", ":")) + "\n"
        atomic.replace_file(target, self._staging(target), lambda file: file.write(text.encode("utf-8")))

    def _staging(self, target: Path) -> Path:
        return target.with_name(f".{os.getpid()}-{target.name}{STAGING}{os.urandom(4).hex()}")

    def close(self) -> None:
        """Release the store's lock."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def __enter__(self) -> "FeatureStoreWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def described(index: Mapping[str, Any]) -> dict[str, Any]:
    """What a writer must agree with to resume a store: its encoder's identity, dtype and feature shape."""
    return {**index["encoder"], "dtype": index["dtype"], "shape": index["shape"]}


def rows_per_shard(shape: Sequence[int], dtype: torch.dtype, shard_bytes: int = DEFAULT_SHARD_BYTES) -> int:
    """How many images' features of ``shape`` in ``dtype`` fit in ``shard_bytes`` (at least one)."""
    return max(1, shard_bytes // (shape[0] * shape[1] * dtype.itemsize))
