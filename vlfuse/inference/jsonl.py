"""JSONL in and out for ``vlfuse predict`` and ``vlfuse caption``: one row per line, bad rows kept in place.

:func:`read_rows` parses a file of JSON objects; a line that is not one becomes a row with an
error, and every other row is still answered. :func:`write_rows` writes one line per input line,
in order, each with its result or its error.
"""

from __future__ import annotations

import json
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


@dataclass
class InputRow:
    """One non-blank line of a ``--input`` JSONL file: its number, its fields, its image path or its error."""

    line: int
    fields: dict
    image: Path | None = None
    error: str | None = None


def read_rows(path: Path, keys: Sequence[str] = ("image", "question")) -> list[InputRow]:
    """Parse a JSONL file of objects with ``keys`` (``image`` among them); a bad line becomes a row with an error.

    Image paths are relative to the file's directory, unless absolute. Blank lines are skipped.
    """
    with open(path, encoding="utf-8", errors="replace") as lines:
        return [_parse_line(n, text, path.parent, keys) for n, text in enumerate(lines, 1) if text.strip()]


def _parse_line(number: int, text: str, base: Path, keys: Sequence[str]) -> InputRow:
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        return InputRow(number, {}, error=f"malformed JSON: {err}")
    if not isinstance(record, dict):
        return InputRow(number, {}, error=f"expected a JSON object with {' and '.join(repr(k) for k in keys)}")
    fields = {key: record[key] for key in keys if key in record}
    missing = [key for key in keys if key not in record]
    if missing:
        return InputRow(number, fields, error=f"missing {' and '.join(repr(k) for k in missing)}")
    if not isinstance(record["image"], str) or not record["image"]:
        return InputRow(number, fields, error="'image' must be a non-empty path string")
    return InputRow(number, fields, image=base / record["image"])


def write_rows(
    rows: list[InputRow], results, target: Path | None, command: str, done: str, attention_maps: Path | None
) -> int:
    """Write one JSONL line per input row, in order, to ``target`` (or standard output): the row's fields
    and its result from ``results`` (an iterator over the readable rows' results), or its error in
    place; report on stderr. Returns the exit status: 1 when a row failed, else 0.

    Args:
        command: the command named in the messages, e.g. ``"vlfuse predict"``.
        done: what was done to every row, e.g. ``"answered"``.
        attention_maps: the directory attention maps were written to, if any.
    """
    failed = []
    if target is not None:
        target.parent.mkdir(parents=True, exist_ok=True)
    where = "standard output" if target is None else str(target)
    with open(target, "w", encoding="utf-8") if target is not None else nullcontext(sys.stdout) as out:
        for row in rows:
            result = {"error": row.error} if row.error is not None else next(results)
            for message in result.get("warnings", []):
                print(f"vlfuse: warning: line {row.line}: {message}", file=sys.stderr)
            if "error" in result:
                result["error"] = f"line {row.line}: {result['error']}"
                failed.append(row.line)
            out.write(json.dumps({"line": row.line, **row.fields, **result}) + "\n")
    if attention_maps is not None:
        print(f"{command}: wrote attention maps to {attention_maps}", file=sys.stderr)
    if failed:
        shown = ", ".join(map(str, failed[:20])) + (", ..." if len(failed) > 20 else "")
        summary = f"{len(failed)} of {len(rows)} rows failed (lines {shown}); see 'error' in {where}"
        print(f"{command}: {summary}", file=sys.stderr)
        return 1
    print(f"{command}: {done} every row ({len(rows)}); wrote {where}", file=sys.stderr)
    return 0
