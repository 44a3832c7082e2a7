"""Tables of rows, one row per question: JSON Lines, JSON, CSV and Parquet files, read alike.

:func:`read_table` chooses the reader by the file's suffix. Every reader gives a :class:`Table`:
the columns its header or schema names (``None`` for JSON and JSON Lines, whose rows each say
what they hold) and its rows as ``(where, row)`` pairs. ``where`` names the file and the row as
messages show them: ``data.csv:3`` and ``metadata.jsonl:3`` for the row on line 3 (a CSV's header
is line 1; a CSV record whose quoted cell holds a line break is named by its first line),
``data.json row 2`` and ``metadata.parquet row 2`` for the row at index 2. ``row`` is the row's
parsed value (a dict for a good row: a CSV's cells as strings, an empty cell as ``""``), or the
:class:`BadRowError` saying why the row cannot be read.

A data file is untrusted: a JSON Lines line is parsed by :func:`~vlfuse.json_input.parse_json`, so
one that is not strict JSON (``NaN``, an integer of more digits than Python converts, nesting too
deep) is a bad row like any malformed line. A CSV record that the ``csv`` module refuses (a cell
longer than its field size limit, text after a quoted cell's closing quote, a quoted cell not closed
before the end of the file) is a bad row too, and reading goes on: from the next line, or, when the
record ran on over several lines inside a quoted cell, from the line after the one that opened
that cell, so that rows a stray quote ran together are each read (or named) again.
"""

from __future__ import annotations

import csv
from collections import deque
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


class _Lines:
    """The lines of a text file, numbered from 1, for a ``csv.reader`` (each reader made of it reads
    on from the last line given): it keeps the lines of the record being read (:meth:`start` begins
    one), and :meth:`again` gives some of them once more."""

    def __init__(self, text: TextIO) -> None:
        self.text = text
        self.number = 0  # of the last line given
        self.record: list[str] = []  # the lines given since start()
        self.first = 1  # the number of record[0]
        self._again: deque[str] = deque()

    def __iter__(self) -> Iterator[str]:
        again, record = self._again, self.record
        while True:
            if again:
                line = again.popleft()
            else:
                line = next(self.text, None)
                if line is None:
                    return
            self.number += 1
            record.append(line)
            yield line

    def start(self) -> int:
        """Begin a record at the next line: its number."""
        self.record.clear()
        self.first = self.number + 1
        return self.first

    def again(self, number: int) -> None:
        """Give the record's lines from line ``number`` on once more, before the rest of the file."""
        self._again.extendleft(reversed(self.record[number - self.first :]))
        self.number = number - 1


def _quote_opened(lines: list[str], first: int) -> int:
    """The number of the line on which a quoted cell that is still open at the end of ``lines`` (a
    record's, numbered from ``first``) was opened, as a ``csv.reader`` of the default dialect reads them."""
    opened, quoted = first, False
    for number, line in enumerate(lines, start=first):
        end = len(line.rstrip("\r\n"))
        at, field_start = 0, True
        while at < end or (quoted and at < len(line)):
            if quoted:
                close = line.find('"', at)
                if close < 0:
                    break
                if line.startswith('"', close + 1):  # a doubled quote, in the cell
                    at = close + 2
                    continue
                quoted, field_start, at = False, False, close + 1
            elif field_start and line[at] == '"':
                quoted, opened, at = True, number, at + 1
            else:  # an unquoted cell (or the text after a closing quote) runs to the next comma
                comma = line.find(",", at, end)
                field_start, at = True, (end if comma < 0 else comma + 1)
    return opened


def _csv_reason(err: csv.Error) -> str:
    message = str(err)
    if message.startswith("field larger than field limit"):
        return f"a cell of more than {csv.field_size_limit()} characters (the csv module's field size limit)"
    if message.endswith("expected after '\"'"):
        return f"text after a quoted cell's closing quote ({message}; a quote inside a quoted cell is written twice)"
    return f"not a CSV record ({message})"


def _bad_record(path: Path, lines: _Lines, err: csv.Error) -> BadRowError:
    """The error of the record ``lines`` was reading when the reader raised ``err``. Reading goes on
    from the line after the record's, or, when it ran on over several lines inside a quoted cell,
    from the line after the one that opened that cell (the lines after it are read again)."""
    first, last = lines.first, lines.number
    where = f"{path}:{first}"
    if str(err) == "unexpected end of data":  # the end of the file inside a quoted cell
        opened = _quote_opened(lines.record, first)
        cell = "a quoted cell" if opened == first else f"a quoted cell opened on line {opened}"
        error = BadRowError(f"{where}: {cell} is not closed before the end of the file (line {last})")
    elif last > first:
        opened = _quote_opened(lines.record[:-1], first)
        error = BadRowError(
            f"{where}: {_csv_reason(err)} on line {last}; the quoted cell opened on line {opened} ran on to it: "
            "is its closing quote missing?"
        )
    else:
        return BadRowError(f"{where}: {_csv_reason(err)}")
    lines.again(opened + 1)
    return error


def _csv_records(path: Path, lines: _Lines) -> Iterator[tuple[int, list[str] | BadRowError]]:
    """``(first line, cells)`` of each record of ``lines``, or a :class:`BadRowError` for one the reader refuses."""
    reader = csv.reader(lines, strict=True)
    while True:
        first = lines.start()
        try:
            cells = next(reader)
        except StopIteration:
            return
        except csv.Error as err:
            yield first, _bad_record(path, lines, err)
            reader = csv.reader(lines, strict=True)
            continue
        yield first, cells


def _header(path: Path, lines: _Lines) -> list[str]:
    """The column names on the first line (none in an empty file).

    Raises:
        BadRowError: the reader refuses the first record.
    """
    for _, cells in _csv_records(path, lines):
        if isinstance(cells, BadRowError):
            raise cells
        return [name.strip() for name in cells]
    return []


def _csv_rows(path: Path) -> Iterator[tuple[str, Any]]:
    with _open_csv(path) as text:
        lines = _Lines(text)
        header = _header(path, lines)
        for first, cells in _csv_records(path, lines):
            where = f"{path}:{first}"
            if isinstance(cells, BadRowError):
                yield where, cells
            elif any(cell.strip() for cell in cells):
                yield where, _csv_row(header, cells, where)


def read_csv(path: Path) -> Table:
    """A CSV file whose first line names the columns (a UTF-8 byte-order mark is allowed); blank lines
    are left out. The rows are read as they are asked for.

    Raises:
        BadRowError: the header cannot be read.
    """
    with _open_csv(path) as text:
        header = _header(path, _Lines(text))
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
        BadRowError: a JSON file that cannot be read as a whole, or a CSV file whose header cannot be read.
    """
    path = Path(path)
    reader = READERS.get(path.suffix.lower())
    if reader is None:
        raise ValueError(f"{path}: not a table vlfuse reads; give a {', '.join(READERS)} file")
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found")
    return reader(path)
