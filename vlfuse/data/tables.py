"""Tables of rows, one row per question: JSON Lines, JSON, CSV and Parquet files, read alike.

:func:`read_table` chooses the reader by the file's suffix. Every reader gives a :class:`Table`:
the columns its header or schema names (``None`` for JSON and JSON Lines, whose rows each say
what they hold) and its rows as ``(where, row)`` pairs. ``where`` names the file and the row as
messages show them: ``data.csv:3`` and ``metadata.jsonl:3`` for the row on line 3 (a CSV's header
is line 1), ``data.json row 2`` and ``metadata.parquet row 2`` for the row at index 2. ``row`` is
the row's parsed value (a dict for a good row: a CSV's cells as strings, an empty cell as ``""``),
or the :class:`BadRowError` saying why the row cannot be read.

A data file is untrusted: a JSON Lines line is parsed by :func:`~vlfuse.json_input.parse_json`, so
one that is not strict JSON (``NaN``, an integer of more digits than Python converts, nesting too
deep) is a bad row like any malformed line.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, TextIO

from vlfuse.json_input import JSONInputError, parse_json

TableRows = Iterable[tuple[str, Any]]
"""``(where, row)`` pairs: the row's parsed value, or a :class:`BadRowError`."""


class BadRowError(ValueError):
    """A row that cannot be used (or a table that cannot be read); the one-line message says where and why."""


@dataclass
class Table:
    """A table's rows, and the columns its header or schema names (``None`` when it has neither)."""

    path: Path
    columns: list[str] | None
    rows: TableRows


def _reason(err: JSONInputError) -> str:
    """Why a line is not JSON; its line is the caller's to name (``parse_json`` counts the lines of one line's text)."""
    return str(err).replace(" (line 1, column ", " (column ")


def _jsonl_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as lines:
        for number, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{number}"
            try:
                yield where, parse_json(raw)
            except JSONInputError as err:
                yield where, BadRowError(f"{where}: {_reason(err)}")


def read_jsonl(path: Path) -> Table:
    """A JSON Lines file: one JSON object a line; blank lines are left out."""
    return Table(path, None, _jsonl_rows(path))


def read_json(path: Path) -> Table:
    """A JSON file holding a list of objects, one per row.

    Raises:
        BadRowError: the file is not UTF-8 text, not strict JSON (:func:`~vlfuse.json_input.parse_json`),
            or does not hold a list.
    """
    try:
        data = parse_json(path.read_bytes())
    except JSONInputError as err:
        raise BadRowError(f"{path}: {err}") from None
    if not isinstance(data, list):
        raise BadRowError(f"{path}: expected a JSON list of objects, one per question; got a {type(data).__name__}")
    return Table(path, None, ((f"{path} row {index}", row) for index, row in enumerate(data)))


def _csv_row(header: list[str], cells: list[str], where: str) -> dict[str, str] | BadRowError:
    """A CSV record as ``{column: cell}``; cells beyond the header, or bytes that are not UTF-8, make it bad."""
    if len(cells) > len(header):
        return BadRowError(f"{where}: {len(cells)} cells, but the header names {len(header)} columns ({', '.join(header)})")
    try:
        "".join(cells).encode("utf-8")
    except UnicodeEncodeError:  # a byte that is not UTF-8, kept by errors="surrogateescape"
        return BadRowError(f"{where}: not UTF-8 text")
    return dict(zip(header, cells))


def _open_csv(path: Path) -> TextIO:
    return path.open(encoding="utf-8-sig", errors="surrogateescape", newline="")


def _header(lines: Iterator[list[str]]) -> list[str]:
    return [name.strip() for name in next(lines, [])]


def _csv_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with _open_csv(path) as text:
        lines = csv.reader(text)
        header = _header(lines)
        for cells in lines:
            if any(cell.strip() for cell in cells):
                where = f"{path}:{lines.line_num}"
                yield where, _csv_row(header, cells, where)


def read_csv(path: Path) -> Table:
    """A CSV file whose first line names the columns (a UTF-8 byte-order mark is allowed); blank lines
    are left out. The rows are read as they are asked for."""
    with _open_csv(path) as text:
        header = _header(csv.reader(text))
    return Table(path, header, _csv_rows(path))


def read_parquet(path: Path) -> Table:
    """A Parquet file (needs ``pyarrow``), read a batch of rows at a time.

    Raises:
        ValueError: ``pyarrow`` is not installed.
    """
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading a Parquet file needs the 'pyarrow' package: pip install pyarrow") from None
    parquet = pq.ParquetFile(path)

    def rows() -> Iterator[tuple[str, Any]]:
        index = 0
        for batch in parquet.iter_batches():
            for row in batch.to_pylist():
                yield f"{path} row {index}", row
                index += 1

    return Table(path, list(parquet.schema_arrow.names), rows())


READERS: dict[str, Callable[[Path], Table]] = {
    ".jsonl": read_jsonl,
    ".json": read_json,
    ".csv": read_csv,
    ".parquet": read_parquet,
}
"""The reader of each table suffix."""


def read_table(path: str | Path) -> Table:
    """The table in ``path``, read by the reader of its suffix (:data:`READERS`).

    Raises:
        FileNotFoundError: no such file.
        ValueError: a suffix that no reader reads, or a Parquet file without ``pyarrow``.
        BadRowError: a JSON file that cannot be read as a whole.
    """
    path = Path(path)
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise ValueError(f"{path}: not a table vlfuse reads; give a {', '.join(READERS)} file")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    return reader(path)
