"""Markdown tables: the one writer behind every report and benchmark table of vlfuse and its scripts."""

from __future__ import annotations

from numbers import Number
from typing import Iterable, Mapping, Sequence

ALIGNMENTS = {"l": ":---", "r": "---:", "c": ":---:"}
MISSING = "-"
"""The cell of ``None``: nothing was measured."""
UNDEFINED = "n/a"
"""The cell of a NaN: measured, but not defined (a correlation of a constant, a pruned head)."""


def markdown_table(
    header: Sequence[str] | Mapping[str, str],
    rows: Iterable[Sequence[object]] | Iterable[Mapping[str, object]],
    *,
    formats: str | Sequence[str | None] | None = None,
    align: str | None = None,
) -> str:
    """A GitHub-flavoured markdown table, one line per row, without a trailing newline.

    Args:
        header: the column titles; or ``{key: title}`` when the rows are mappings, whose values at
            those keys are the cells (other keys are left out).
        rows: one sequence of cells per row, as long as ``header``. A number is written with its
            column's format; ``None`` as ``-``; a NaN as ``n/a``; anything else with ``str``, a
            ``|`` in it escaped.
        formats: a :meth:`str.format` pattern for the numbers of each column, e.g.
            ``[None, "{:.2f}", "{:.1%}", "{:.2f}x"]`` (``None``: ``str``), or one pattern for every column.
        align: one letter per column, ``l`` (left), ``r`` (right) or ``c`` (centre). By default a
            column is right-aligned when all its cells are numbers (or missing), else left-aligned.

    Raises:
        ValueError: a row, ``formats`` or ``align`` does not have one entry per column, or ``align``
            has a letter other than ``l``, ``r``, ``c``.
    """
    if isinstance(header, Mapping):
        rows = [[row[key] for key in header] for row in rows]
        header = list(header.values())
    width = len(header)
    rows = [list(row) for row in rows]
    for number, row in enumerate(rows):
        if len(row) != width:
            raise ValueError(f"row {number} has {len(row)} cells for {width} columns: {row}")
    if formats is None or isinstance(formats, str):
        formats = [formats] * width
    if len(formats) != width:
        raise ValueError(f"formats has {len(formats)} entries for {width} columns")
    if align is None:
        align = "".join("r" if all(_is_number(row[c]) or row[c] is None for row in rows) else "l" for c in range(width))
    if len(align) != width or set(align) - set(ALIGNMENTS):
        raise ValueError(f"align must be one of l, r, c per column ({width}), got {align!r}")
    lines = [_line(_escape(str(title)) for title in header), "|" + "|".join(ALIGNMENTS[a] for a in align) + "|"]
    lines += [_line(_cell(value, pattern) for value, pattern in zip(row, formats)) for row in rows]
    return "\n".join(lines)


def _is_number(value: object) -> bool:
    return isinstance(value, Number) and not isinstance(value, bool)


def _cell(value: object, pattern: str | None) -> str:
    if value is None:
        return MISSING
    if _is_number(value):
        if value != value:  # NaN, of any float type
            return UNDEFINED
        return pattern.format(value) if pattern else str(value)
    return _escape(str(value))


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _line(cells: Iterable[str]) -> str:
    return "| " + " | ".join(cells) + " |"
