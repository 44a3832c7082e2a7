"""VQA data in the Hugging Face ``imagefolder`` layout, or any ``datasets`` dataset.

A split is a folder of images with a ``metadata.jsonl``, one JSON object a line::

    {"file_name": "0001.png", "question": "what shape is this?", "answer": "circle"}
    {"file_name": "0001.png", "question": "what colour is it?", "answers": ["red", "red", "dark red"]}

``answer`` is one answer, used as written; ``answers`` is every annotator's answer (as VQA v2),
normalised by VQA's rules (:func:`~vlfuse.data.vqa_v2.normalize_answer`): its majority answer is
the label and all of them give the soft accuracy. Rows naming the same image become one
:class:`ImageQuestions`, so the image is encoded once per batch for all its questions.

Every row is checked, and every image decoded once, when the split is loaded: a bad row raises a
:class:`BadRowError` whose one line names the metadata file, the line and the image, or, with
``skip_bad_rows``, is left out and counted. A ``file_name`` must stay inside the split's folder
once ``..`` and symbolic links are resolved (an absolute path, or one that climbs out, is a bad
row) unless ``allow_outside_paths`` is set. Images are opened by
:func:`~vlfuse.data.transforms.open_image`, so an image over
:data:`~vlfuse.data.transforms.MAX_IMAGE_PIXELS` is a bad row too, found before it is decoded.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping

from PIL import Image

from vlfuse.data.records import ImageQuestions, ImageSource
from vlfuse.data.transforms import ImageLoadError, load_image, open_image
from vlfuse.data.vqa_v2 import majority_answer, normalize_answer

METADATA_FILE = "metadata.jsonl"
COLUMNS = ("image", "question", "answer", "answers")


class BadRowError(ValueError):
    """A metadata row that cannot be used; the one-line message says where and why."""


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


def _text(row: Mapping, column: str, where: str) -> str:
    value = row.get(column)
    if not isinstance(value, str) or not value.strip():
        raise BadRowError(f"{where}: no {column!r} (a non-empty string); got {value!r}")
    return value.strip()


def _answers(row: Mapping, columns: Mapping[str, str], where: str) -> tuple[str, list[str]]:
    """(label, human answers) of a row with an ``answer`` string or an ``answers`` list."""
    humans = row.get(columns["answers"])
    if humans is not None:
        if not isinstance(humans, list) or not humans or not all(isinstance(a, str) and a.strip() for a in humans):
            raise BadRowError(f"{where}: {columns['answers']!r} must be a non-empty list of answers; got {humans!r}")
        humans = [normalize_answer(a) for a in humans]
        label = normalize_answer(row[columns["answer"]]) if isinstance(row.get(columns["answer"]), str) else None
        return label or majority_answer(humans), humans
    if columns["answer"] not in row:
        raise BadRowError(f"{where}: no {columns['answer']!r} (a string) or {columns['answers']!r} (a list)")
    return _text(row, columns["answer"], where), []


def _question_and_answers(row: Any, columns: Mapping[str, str], where: str) -> tuple[str, str, list[str]]:
    if not isinstance(row, dict):
        raise BadRowError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return (_text(row, columns["question"], where), *_answers(row, columns, where))


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


def _inside(split_dir: Path, file_name: str, where: str) -> Path:
    """``split_dir / file_name``, which must lie inside ``split_dir`` once ``..`` and links are resolved."""
    path = split_dir / file_name
    if not path.resolve().is_relative_to(split_dir.resolve()):
        raise BadRowError(
            f"{where}: file_name {file_name!r} is outside the split folder {split_dir} "
            "(allow_outside_paths reads it)"
        )
    return path


def _folder_rows(
    split_dir: Path, metadata: Path, image_size: int | None, allow_outside_paths: bool
) -> Iterable[_Row | BadRowError]:
    columns = {"image": "file_name", "question": "question", "answer": "answer", "answers": "answers"}
    check = _Checked(image_size)
    with metadata.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            where = f"{metadata}:{number}"
            try:
                try:
                    row = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as err:
                    raise BadRowError(f"{where}: not UTF-8 text: {err.reason} at byte {err.start}") from None
                except json.JSONDecodeError as err:
                    raise BadRowError(f"{where}: not valid JSON: {err.msg} (column {err.colno})") from None
                question, answer, humans = _question_and_answers(row, columns, where)
                file_name = _text(row, columns["image"], where)
                path = split_dir / file_name if allow_outside_paths else _inside(split_dir, file_name, where)
                check(file_name, path, where)
                yield _Row(file_name, str(path), question, answer, humans)
            except BadRowError as err:
                yield err


def load_imagefolder_split(
    split_dir: str | Path,
    *,
    skip_bad_rows: bool = False,
    image_size: int | None = None,
    allow_outside_paths: bool = False,
) -> LoadedSplit:
    """Read one split folder (images and ``metadata.jsonl``).

    Args:
        split_dir: the folder, e.g. ``DATA/train``.
        skip_bad_rows: leave out (and count) rows with malformed JSON, no question, no answer, a
            missing, unreadable or too large image, or a path outside ``split_dir``, instead of raising.
        image_size: the side images will be resized to, so that each is checked as training decodes
            it; ``None`` checks them at full size.
        allow_outside_paths: read a ``file_name`` that is absolute or leads outside ``split_dir``
            (through ``..`` or a symbolic link) instead of refusing it.

    Raises:
        FileNotFoundError: no ``metadata.jsonl`` in ``split_dir``.
        BadRowError: a bad row (the message names the file, the line and the image).
    """
    split_dir = Path(split_dir)
    metadata = split_dir / METADATA_FILE
    if not metadata.is_file():
        raise FileNotFoundError(f"{metadata} not found: an imagefolder split is a folder of images with a {METADATA_FILE}")
    return _group(_folder_rows(split_dir, metadata, image_size, allow_outside_paths), skip_bad_rows)


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
    unknown = sorted(set(columns or {}) - set(COLUMNS))
    if unknown:
        raise ValueError(f"columns: unknown keys {unknown}; expected some of {list(COLUMNS)}")
    mapping = {**{c: c for c in COLUMNS}, **(columns or {})}
    return _group(_hub_rows(rows, mapping, source), skip_bad_rows)


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
    """
    try:
        import datasets
    except ImportError:  # a ValueError: the CLI shows it as one line
        raise ValueError(f"reading the datasets dataset {name!r} needs the 'datasets' package: pip install datasets") from None
    data = datasets.load_dataset(name, config_name, split=split)
    image_column = (columns or {}).get("image", "image")
    if isinstance(data.features.get(image_column), datasets.Image):
        data = data.cast_column(image_column, datasets.Image(decode=False))
    return records_from_rows(data, columns, source=f"{name} [{split}]", skip_bad_rows=skip_bad_rows)
