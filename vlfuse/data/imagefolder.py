"""VQA data in the Hugging Face ``imagefolder`` layout, in a table of rows, or any ``datasets`` dataset.

A split is a folder of images with one metadata file (:data:`METADATA_FILES`): ``metadata.jsonl``
(one JSON object a line), ``metadata.csv`` (a header line, then one row a line) or
``metadata.parquet`` (with ``pyarrow``), one row per question::

    {"file_name": "0001.png", "question": "what shape is this?", "answer": "circle"}
    {"file_name": "0001.png", "question": "what colour is it?", "answers": ["red", "red", "dark red"]}

A table of rows (:func:`load_table`: CSV, JSON, JSON Lines or Parquet, see :mod:`vlfuse.data.tables`)
holds the same rows, its image paths relative to its own folder. ``columns`` says which column
holds each field when they are named otherwise.

``answer`` is one answer, used as written; ``answers`` is every annotator's answer (as VQA v2; in
a CSV cell, a JSON list), normalised by VQA's rules (:func:`~vlfuse.data.vqa_v2.normalize_answer`):
its majority answer is the label and all of them give the soft accuracy. Rows naming the same
image become one :class:`ImageQuestions`, so the image is encoded once per batch for all its questions.

Every row is checked, and every image decoded once, when the split is loaded: a bad row raises a
:class:`BadRowError` whose one line names the file, the line and the image, or, with
``skip_bad_rows``, is left out and counted. A ``file_name`` must stay inside the table's folder
once ``..`` and symbolic links are resolved (an absolute path, or one that climbs out, is a bad
row) unless ``allow_outside_paths`` is set. Images are opened by
:func:`~vlfuse.data.transforms.open_image`, so an image over
:data:`~vlfuse.data.transforms.MAX_IMAGE_PIXELS` is a bad row too, found before it is decoded.

The split folders are found by name (:data:`SPLIT_NAMES`: ``validation``, ``val``, ``valid`` or
``dev`` for the validation split, ...; :func:`find_split`).
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from PIL import Image

from vlfuse.data.records import ImageQuestions, ImageSource
from vlfuse.data.tables import BadRowError, Table, read_table
from vlfuse.data.transforms import ImageLoadError, load_image, open_image
from vlfuse.data.vqa_v2 import majority_answer, normalize_answer
from vlfuse.json_input import JSONInputError, parse_json

METADATA_FILE = "metadata.jsonl"
"""The metadata file that vlfuse writes (scripts/easy_vqa_as_imagefolder.py)."""
METADATA_FILES = (METADATA_FILE, "metadata.csv", "metadata.parquet")
"""The metadata files a split folder may hold (one of them), as Hugging Face's imagefolder reads them."""
COLUMNS = ("image", "question", "answer", "answers")
FOLDER_COLUMNS = {"image": "file_name", "question": "question", "answer": "answer", "answers": "answers"}
"""The column of each field in a metadata file or table, unless ``columns`` says otherwise."""
SPLIT_NAMES = {"train": ("train",), "val": ("validation", "val", "valid", "dev"), "test": ("test", "testing")}
"""vlfuse's split -> the names it goes by (a split folder's, a ``data_files`` key), the first the Hugging Face one."""


@dataclass
class LoadedSplit:
    """The records of one split and the number of bad rows left out (``skip_bad_rows``)."""

    records: list[ImageQuestions]
    skipped: int = 0


@dataclass
class _Row:
    image_key: str
    image: ImageSource
    question: str
    answer: str
    human_answers: list[str]


# ------------------------------------------------------------------------------ split names
def split_label(split: str) -> str:
    """How messages name vlfuse's ``split``: its Hugging Face name (``val`` -> ``validation``)."""
    return SPLIT_NAMES[split][0]


def find_split(present: Iterable[str], split: str, where: str, mark: str = "") -> str | None:
    """The name among ``present`` that ``split`` goes by (:data:`SPLIT_NAMES`), ``None`` if none.

    Args:
        present: the names there are (folders, ``data_files`` keys).
        split: 'train', 'val' or 'test'.
        where: how messages name the place, e.g. the data folder.
        mark: put after each name in messages (``/`` for folders).

    Raises:
        ValueError: two names of the split are present.
    """
    present = set(present)
    found = [name for name in SPLIT_NAMES[split] if name in present]
    if len(found) > 1:
        names = " and ".join(f"{name}{mark}" for name in found)
        raise ValueError(f"{where} has {len(found)} {split_label(split)} splits, {names}: keep one")
    return found[0] if found else None


def no_split(present: Iterable[str], split: str, where: str, mark: str = "") -> FileNotFoundError:
    """The error for ``where`` without ``split``: every name looked for, and what was found."""
    looked = ", ".join(f"{name}{mark}" for name in SPLIT_NAMES[split])
    found = ", ".join(f"{name}{mark}" for name in present) or "nothing"
    return FileNotFoundError(f"{where} has no {split_label(split)} split: looked for {looked}; found {found}")


def subfolders(data_dir: Path) -> list[str]:
    """The names of ``data_dir``'s folders (hidden ones aside), sorted.

    Raises:
        FileNotFoundError: ``data_dir`` is not a folder.
    """
    if not data_dir.is_dir():
        raise FileNotFoundError(f"{data_dir} not found: data_dir is the folder holding train/, validation/ and test/")
    return sorted(entry.name for entry in data_dir.iterdir() if entry.is_dir() and not entry.name.startswith("."))


def split_folder(data_dir: Path, split: str) -> Path:
    """The folder of ``split`` in ``data_dir`` (:func:`find_split`).

    Raises:
        FileNotFoundError: none of its names is a folder there.
        ValueError: two of them are.
    """
    present = subfolders(data_dir)
    name = find_split(present, split, str(data_dir), "/")
    if name is None:
        raise no_split(present, split, str(data_dir), "/")
    return data_dir / name


def find_metadata(split_dir: Path) -> Path:
    """The one metadata file (:data:`METADATA_FILES`) of a split folder.

    Raises:
        FileNotFoundError: it has none.
        ValueError: it has several.
    """
    found = [split_dir / name for name in METADATA_FILES if (split_dir / name).is_file()]
    if not found:
        raise FileNotFoundError(
            f"{split_dir} has no metadata file: looked for {', '.join(METADATA_FILES)} "
            "(an imagefolder split is a folder of images with one)"
        )
    if len(found) > 1:
        raise ValueError(f"{split_dir} has {' and '.join(path.name for path in found)}: keep one metadata file per split")
    return found[0]


# ------------------------------------------------------------------------------ columns
def column_mapping(columns: Mapping[str, str] | None) -> dict[str, str]:
    """The column of every field: :data:`FOLDER_COLUMNS`, with those ``columns`` names replaced.

    Raises:
        ValueError: ``columns`` names a field that is not one of :data:`COLUMNS`.
    """
    unknown = sorted(set(columns or {}) - set(COLUMNS))
    if unknown:
        raise ValueError(f"columns: unknown keys {unknown}; expected some of {list(COLUMNS)}")
    return {**FOLDER_COLUMNS, **(columns or {})}


def _suggest(field: str, present: Iterable[str], columns: Mapping[str, str]) -> str:
    """``set --data.init_args.columns.question q``: the one unmapped column that starts as ``field`` does, if any."""
    unmapped = [name for name in present if name not in columns.values() and name[:1].lower() == field[0]]
    column = unmapped[0] if len(unmapped) == 1 else "to the column that holds it"
    return f"set --data.init_args.columns.{field} {column}"


def check_columns(source: str, present: list[str], columns: Mapping[str, str]) -> None:
    """Check that a table whose header or schema names ``present`` has a column for every field.

    Raises:
        BadRowError: a field has no column; the message lists the columns and the setting to give.
    """
    listed = ", ".join(present) or "none"
    for field in ("image", "question"):
        if columns[field] not in present:
            raise BadRowError(f"{source}: no column {columns[field]!r} (columns: {listed}); {_suggest(field, present, columns)}")
    if columns["answer"] not in present and columns["answers"] not in present:
        raise BadRowError(
            f"{source}: no column {columns['answer']!r} or {columns['answers']!r} (columns: {listed}); "
            f"{_suggest('answer', present, columns)}"
        )


# ------------------------------------------------------------------------------ rows
def _absent(row: Mapping, field: str, columns: Mapping[str, str]) -> str:
    """What a row without ``field``'s column holds instead, and the setting that would name it."""
    return f"the row has {', '.join(map(str, row)) or 'nothing'}; {_suggest(field, map(str, row), columns)}"


def _text(row: Mapping, field: str, columns: Mapping[str, str], where: str) -> str:
    column = columns[field]
    value = row.get(column)
    if column not in row:
        raise BadRowError(f"{where}: no {column!r} (a non-empty string); {_absent(row, field, columns)}")
    if not isinstance(value, str) or not value.strip():
        raise BadRowError(f"{where}: no {column!r} (a non-empty string); got {_shown(value)}")
    return value.strip()


def _shown(value: Any, limit: int = 100) -> str:
    """``repr(value)`` for a message, cut after ``limit`` characters (a cell may hold megabytes)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text):,} characters)"


def _listed(value: Any, column: str, where: str) -> list[str]:
    """A non-empty list of answers: a list, or (in a cell of text, as a CSV's) the JSON text of one."""
    listed = value
    if isinstance(value, str):
        try:
            listed = parse_json(value)
        except JSONInputError:  # not JSON, or too deep, too long a number: not a list of answers
            pass
    if not isinstance(listed, list) or not listed or not all(isinstance(a, str) and a.strip() for a in listed):
        raise BadRowError(
            f"{where}: {column!r} must be a non-empty list of answers (in a CSV cell, a JSON list: "
            f'["red", "dark red"]); got {_shown(value)}'
        )
    return listed


def _answers(row: Mapping, columns: Mapping[str, str], where: str) -> tuple[str, list[str]]:
    """(label, human answers) of a row with an ``answer`` string or an ``answers`` list; an empty
    value (a CSV's empty cell, a null) is as good as none."""
    humans = row.get(columns["answers"])
    if humans is not None and humans != "":
        humans = [normalize_answer(a) for a in _listed(humans, columns["answers"], where)]
        label = normalize_answer(row[columns["answer"]]) if isinstance(row.get(columns["answer"]), str) else None
        return label or majority_answer(humans), humans
    if columns["answer"] not in row:
        raise BadRowError(
            f"{where}: no {columns['answer']!r} (a string) or {columns['answers']!r} (a list); {_absent(row, 'answer', columns)}"
        )
    return _text(row, "answer", columns, where), []


def _question_and_answers(row: Any, columns: Mapping[str, str], where: str) -> tuple[str, str, list[str]]:
    if not isinstance(row, dict):
        raise BadRowError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return (_text(row, "question", columns, where), *_answers(row, columns, where))


class _Checked:
    """Decodes each distinct image once and remembers what went wrong with it.

    ``image_size``: the side images will be resized to (JPEGs then decode at a reduced scale, as in
    training); ``None`` decodes them at full size.
    """

    def __init__(self, image_size: int | None = None) -> None:
        self.errors: dict[str, str | None] = {}
        self.image_size = image_size

    def __call__(self, key: str, image: ImageSource, where: str) -> None:
        if key not in self.errors:
            try:
                load_image(image, self.image_size)
                self.errors[key] = None
            except ImageLoadError as err:
                self.errors[key] = str(err).splitlines()[0]
        if self.errors[key] is not None:
            raise BadRowError(f"{where}: {self.errors[key]}")


def _group(rows: Iterable[_Row | BadRowError], skip_bad_rows: bool) -> LoadedSplit:
    """One record per image, in order of first mention; a bad row raises, or is counted.

    When any row has human answers, a row with a single ``answer`` counts as one human's answer.
    """
    good: list[_Row] = []
    skipped = 0
    for row in rows:
        if isinstance(row, BadRowError):
            if not skip_bad_rows:
                raise row
            skipped += 1
        else:
            good.append(row)
    with_humans = any(row.human_answers for row in good)
    by_image: dict[str, ImageQuestions] = {}
    for row in good:
        record = by_image.setdefault(row.image_key, ImageQuestions(row.image, [], [], image_id=row.image_key))
        record.questions.append(row.question)
        record.answers.append(row.answer)
        if with_humans:
            record.human_answers.append(row.human_answers or [row.answer])
    return LoadedSplit(list(by_image.values()), skipped)


class _Inside:
    """``folder / file_name`` for the rows of one table, each of which must lie inside ``folder`` once
    ``..`` and links are resolved; each distinct ``file_name`` is resolved once (a table of 200,000
    rows over 20,000 images resolves 20,000 paths).

    Args:
        folder: the table's folder.
        column: the image column's name, for messages.
        within: how messages name ``folder``.
    """

    def __init__(self, folder: Path, column: str, within: str) -> None:
        self.folder = folder
        self.resolved = folder.resolve()
        self.column = column
        self.within = within
        self.paths: dict[str, Path | None] = {}  # None: outside

    def __call__(self, file_name: str, where: str) -> Path:
        if file_name not in self.paths:
            path = self.folder / file_name
            self.paths[file_name] = path if path.resolve().is_relative_to(self.resolved) else None
        path = self.paths[file_name]
        if path is None:
            raise BadRowError(f"{where}: {self.column} {file_name!r} is outside {self.within} (allow_outside_paths reads it)")
        return path


def _table_rows(
    table: Table, columns: Mapping[str, str], within: str, image_size: int | None, allow_outside_paths: bool
) -> Iterable[_Row | BadRowError]:
    folder = table.path.parent
    check = _Checked(image_size)
    inside = _Inside(folder, columns["image"], within)
    for where, row in table.rows:
        try:
            if isinstance(row, BadRowError):
                raise row
            question, answer, humans = _question_and_answers(row, columns, where)
            file_name = _text(row, "image", columns, where)
            path = folder / file_name if allow_outside_paths else inside(file_name, where)
            check(file_name, path, where)
            yield _Row(file_name, str(path), question, answer, humans)
        except BadRowError as err:
            yield err


def load_table(
    path: str | Path,
    *,
    columns: Mapping[str, str] | None = None,
    skip_bad_rows: bool = False,
    image_size: int | None = None,
    allow_outside_paths: bool = False,
    within: str | None = None,
) -> LoadedSplit:
    """Read a table of rows (:func:`~vlfuse.data.tables.read_table`: CSV, JSON, JSON Lines or
    Parquet), one per question, whose image paths are relative to the table's folder.

    Args:
        path: the table, e.g. ``DATA/train/metadata.csv`` or ``data.csv``.
        columns: which column holds ``image``, ``question``, ``answer`` (a string) and ``answers``
            (a list of human answers); unnamed ones are ``file_name``, ``question``, ``answer``, ``answers``.
        skip_bad_rows: leave out (and count) rows that cannot be read, with no question, no answer,
            a missing, unreadable or too large image, or a path outside the table's folder, instead of raising.
        image_size: the side images will be resized to, so that each is checked as training decodes
            it; ``None`` checks them at full size.
        allow_outside_paths: read an image path that is absolute or leads outside the table's folder
            (through ``..`` or a symbolic link) instead of refusing it.
        within: how messages name the table's folder (default: ``DIR, the folder of data.csv``).

    Raises:
        FileNotFoundError: no such table.
        ValueError: not a table vlfuse reads, or ``columns`` names an unknown field.
        BadRowError: a table without a column for a field, or a bad row (the message names the
            file, the line and the image).
    """
    path = Path(path)
    mapping = column_mapping(columns)
    table = read_table(path)
    if table.columns is not None:
        check_columns(str(path), table.columns, mapping)
    within = within or f"{path.parent}, the folder of {path.name}"
    return _group(_table_rows(table, mapping, within, image_size, allow_outside_paths), skip_bad_rows)


def load_imagefolder_split(
    split_dir: str | Path,
    *,
    columns: Mapping[str, str] | None = None,
    skip_bad_rows: bool = False,
    image_size: int | None = None,
    allow_outside_paths: bool = False,
) -> LoadedSplit:
    """Read one split folder: its images and its metadata file (:func:`find_metadata`), as
    :func:`load_table` reads a table (the arguments are its own).

    Raises:
        FileNotFoundError: no metadata file in ``split_dir``.
        ValueError: several.
        BadRowError: a bad row (the message names the file, the line and the image).
    """
    split_dir = Path(split_dir)
    return load_table(
        find_metadata(split_dir),
        columns=columns,
        skip_bad_rows=skip_bad_rows,
        image_size=image_size,
        allow_outside_paths=allow_outside_paths,
        within=f"the split folder {split_dir}",
    )


def _hub_image(value: Any, where: str) -> tuple[str, ImageSource]:
    """(grouping key, image) of a ``datasets`` image cell: a path, ``{"path", "bytes"}`` or a PIL image."""
    if isinstance(value, str):
        return value, value
    if isinstance(value, dict) and (value.get("bytes") or value.get("path")):
        data = value.get("bytes")
        if not data:
            return value["path"], value["path"]
        key = value.get("path") or hashlib.sha1(data).hexdigest()
        return key, open_image(io.BytesIO(data), value.get("path") or "the image")
    if isinstance(value, Image.Image):
        return hashlib.sha1(value.tobytes()).hexdigest(), value
    raise BadRowError(f"{where}: the image column holds {type(value).__name__}, not an image")


def _hub_rows(rows: Iterable[Mapping], columns: Mapping[str, str], source: str) -> Iterable[_Row | BadRowError]:
    check = _Checked()
    for index, row in enumerate(rows):
        where = f"{source} row {index}"
        try:
            question, answer, humans = _question_and_answers(dict(row), columns, where)
            key, image = _hub_image(row.get(columns["image"]), where)
            check(key, image, where)
            yield _Row(key, image, question, answer, humans)
        except BadRowError as err:
            yield err
        except ImageLoadError as err:
            yield BadRowError(f"{where}: {err}")


HUB_COLUMNS = {"image": "image"}
"""A ``datasets`` dataset's image column, unless ``columns`` says otherwise (the others as :data:`FOLDER_COLUMNS`)."""


def records_from_rows(
    rows: Iterable[Mapping], columns: Mapping[str, str] | None = None, *, source: str = "dataset", skip_bad_rows: bool = False
) -> LoadedSplit:
    """Records from rows of a ``datasets`` dataset (or any mappings), checked like a metadata file.

    Args:
        rows: one mapping per question.
        columns: which column holds ``image``, ``question``, ``answer`` (a string) and ``answers``
            (a list of human answers); unnamed ones keep those names.
        source: how messages name the data, e.g. ``"user/vqa [train]"``.
        skip_bad_rows: leave out and count bad rows instead of raising.
    """
    return _group(_hub_rows(rows, column_mapping({**HUB_COLUMNS, **(columns or {})}), source), skip_bad_rows)


def load_hub_split(
    name: str,
    split: str,
    columns: Mapping[str, str] | None = None,
    *,
    config_name: str | None = None,
    skip_bad_rows: bool = False,
) -> LoadedSplit:
    """One split of a ``datasets`` dataset (hub name or local path), read as :func:`records_from_rows`.

    Images are kept encoded (``decode=False``) until each is checked and batched.

    Raises:
        ValueError: the ``datasets`` package is not installed.
        BadRowError: the split has no column for a field, or a bad row.
    """
    try:
        import datasets
    except ImportError:  # a ValueError: the CLI shows it as one line
        raise ValueError(f"reading the datasets dataset {name!r} needs the 'datasets' package: pip install datasets") from None
    mapping = column_mapping({**HUB_COLUMNS, **(columns or {})})
    data = datasets.load_dataset(name, config_name, split=split)
    source = f"{name} [{split}]"
    check_columns(source, list(data.column_names), mapping)
    if isinstance(data.features.get(mapping["image"]), datasets.Image):
        data = data.cast_column(mapping["image"], datasets.Image(decode=False))
    return records_from_rows(data, mapping, source=source, skip_bad_rows=skip_bad_rows)
