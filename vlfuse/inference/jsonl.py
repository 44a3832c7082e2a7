"""JSONL in and out for ``vlfuse predict`` and ``vlfuse caption``: one row per line, bad rows kept in place.

:func:`read_rows` parses a file of JSON objects; a line that is not one becomes a row with an
error, and every other row is still answered. :func:`write_rows` writes one line per input line,
in order, each with its result or its error, batch by batch as the results come. :class:`JsonlOutput`
is where the lines go: standard output, or an ``--output`` file written through a locked partial
file beside it (:func:`partial_path`) and renamed onto it at the end, so that a killed run leaves
the old file as it was and two runs never mix their rows in one file.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

from vlfuse.json_input import JSONInputError, parse_json


@dataclass
class InputRow:
    """One non-blank line of a ``--input`` JSONL file: its number, its fields, its image path or its error."""

    line: int
    fields: dict
    image: Path | None = None
    error: str | None = None


def read_rows(path: Path, keys: Sequence[str] = ("image", "question")) -> list[InputRow]:
    """Parse a JSONL file of objects with ``keys`` (``image`` among them); a bad line becomes a row with an error.

    A line must be UTF-8 text and strict JSON (:func:`~vlfuse.json_input.parse_json`: no ``NaN``, no
    integer of more digits than Python converts, no nesting too deep). Image paths are relative to
    the file's directory, unless absolute. Blank lines are skipped.
    """
    with open(path, "rb") as lines:
        return [_parse_line(n, raw, path.parent, keys) for n, raw in enumerate(lines, 1) if raw.strip()]


def _parse_line(number: int, raw: bytes, base: Path, keys: Sequence[str]) -> InputRow:
    try:
        record = parse_json(raw)  # bytes that are not UTF-8 text are its error too
    except JSONInputError as err:
        return InputRow(number, {}, error=str(err))
    if not isinstance(record, dict):
        return InputRow(number, {}, error=f"expected a JSON object with {' and '.join(repr(k) for k in keys)}")
    fields = {key: record[key] for key in keys if key in record}
    missing = [key for key in keys if key not in record]
    if missing:
        return InputRow(number, fields, error=f"missing {' and '.join(repr(k) for k in missing)}")
    if not isinstance(record["image"], str) or not record["image"]:
        return InputRow(number, fields, error="'image' must be a non-empty path string")
    return InputRow(number, fields, image=base / record["image"])


# ------------------------------------------------------------------------------------ the output
def partial_path(target: Path) -> Path:
    """The file a run writes before renaming it onto ``target``: ``.NAME.partial`` in the same folder."""
    return target.with_name(f".{target.name}.partial")


class JsonlOutput:
    """Where a run's JSONL lines go: standard output (``target`` ``None``), or the file ``target``.

    A file is checked and locked when the object is made, before the run loads its model: it must
    not be ``source`` (the input) nor a folder or a read-only file, and its partial file
    (:func:`partial_path`) is created, or a killed run's taken over, locked for this run
    (``flock``, exclusive) and emptied; another run holding the lock is a ``ValueError``. Each
    :meth:`write` goes to the partial file at once; :meth:`finish` renames it onto ``target``.
    :meth:`close` (the end of a ``with`` block) releases the lock; without :meth:`finish` (the run
    failed), the partial file keeps the rows written so far, or is removed when there are none.
    """

    def __init__(self, target: Path | None, source: Path) -> None:
        self.target = target
        self.where = "standard output" if target is None else str(target)
        self._fd: int | None = None
        self._written = 0
        self._finished = False
        if target is not None:
            check_output(source, target)
            self._fd = _lock_partial(target)

    def __enter__(self) -> "JsonlOutput":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def write(self, lines: list[str]) -> None:
        """Write one batch of ``lines`` (each ending with a newline) and hand it to the system at once."""
        text = "".join(lines)
        if self._fd is None:
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        data = memoryview(text.encode("utf-8"))
        while data:
            data = data[os.write(self._fd, data) :]
        self._written += len(text)

    def finish(self) -> None:
        """The output is complete: sync the partial file to disk and rename it onto the target."""
        if self._fd is None:
            return
        os.fsync(self._fd)
        _keep_mode(self._fd, self.target)
        os.replace(partial_path(self.target), self.target)
        self._finished = True

    def close(self) -> None:
        """Release the lock; an unfinished partial file without a row is removed first."""
        if self._fd is None:
            return
        if not self._finished and self._written == 0:
            partial_path(self.target).unlink(missing_ok=True)
        os.close(self._fd)
        self._fd = None


def check_output(source: Path, target: Path) -> None:
    """Refuse an ``--output`` that is the ``--input`` file (the same path, a link to it or a hard
    link of it), a folder, or a file this user may not write."""
    same = target.resolve() == source.resolve()
    if not same and source.exists() and target.exists():
        same = os.path.samefile(source, target)
    if same:
        raise ValueError(f"--output {target} is the same file as --input {source}; give another --output")
    if target.is_dir():
        raise ValueError(f"--output {target} is a folder; give a file")
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"--output {target} is read-only; give another --output or make it writable")


def _lock_partial(target: Path) -> int:
    """Open ``target``'s partial file (creating it and its folder), lock it for this run and empty
    it: its descriptor. A ``ValueError`` when another run holds the lock.

    The lock must be on the file the path names once it is taken: a run that ends renames its
    partial file onto ``target`` (or removes it) between this run's open and its lock, and that
    file is then the other run's output, not this run's to empty. Then the new file is opened.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = partial_path(target)
    while True:
        fd = _open_partial(partial)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ValueError(
                f"another run is writing {target} (it holds the lock on {partial}); wait for it to end or give "
                "another --output"
            ) from None
        if _names(partial, fd):
            _check_owner(fd, partial)
            os.ftruncate(fd, 0)
            return fd
        os.close(fd)


def _open_partial(partial: Path) -> int:
    """Open (or create) ``partial`` for writing without truncating it, and never through a symbolic link."""
    try:
        return os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ValueError(f"{partial} is a symbolic link; remove it (vlfuse writes the output there first)") from None
        raise ValueError(f"cannot write {partial} (vlfuse writes the output there first): {err.strerror}") from None


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        now = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (now.st_dev, now.st_ino) == (opened.st_dev, opened.st_ino)


def _check_owner(fd: int, partial: Path) -> None:
    """Refuse to take over a partial file that another user made (it would become the output, theirs)."""
    if os.fstat(fd).st_uid != os.geteuid():
        os.close(fd)
        raise ValueError(f"{partial} belongs to another user; remove it or give another --output")


def _keep_mode(fd: int, target: Path) -> None:
    """Give the file open as ``fd`` the permissions of ``target``, when it is a file that exists."""
    try:
        mode = os.lstat(target).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode):
        os.fchmod(fd, stat.S_IMODE(mode))


# ------------------------------------------------------------------------------------ the rows
def write_rows(
    rows: list[InputRow],
    batches: Iterable[list[dict]],
    out: JsonlOutput,
    command: str,
    done: str,
    attention_maps: Path | None,
) -> int:
    """Write one JSONL line per input row, in order, to ``out``: the row's fields and its result, or
    its error in place; one write per batch of results, then :meth:`JsonlOutput.finish`; report on
    stderr. Returns the exit status: 1 when a row failed, else 0.

    Args:
        rows: every input row, readable or not.
        batches: the readable rows' results, in order, batch by batch (lists of dicts).
        command: the command named in the messages, e.g. ``"vlfuse predict"``.
        done: what was done to every row, e.g. ``"answered"``.
        attention_maps: the directory attention maps were written to, if any.
    """
    failed: list[int] = []
    for paired in _paired(rows, batches):
        out.write([_line(row, result, failed) for row, result in paired])
    out.finish()
    if attention_maps is not None:
        print(f"{command}: wrote attention maps to {attention_maps}", file=sys.stderr)
    if failed:
        shown = ", ".join(map(str, failed[:20])) + (", ..." if len(failed) > 20 else "")
        summary = f"{len(failed)} of {len(rows)} rows failed (lines {shown}); see 'error' in {out.where}"
        print(f"{command}: {summary}", file=sys.stderr)
        return 1
    print(f"{command}: {done} every row ({len(rows)}); wrote {out.where}", file=sys.stderr)
    return 0


def _paired(rows: list[InputRow], batches: Iterable[list[dict]]) -> Iterator[list[tuple[InputRow, dict]]]:
    """Every row with its result, in order, batch by batch: an unreadable row (its error as its
    result) goes with the batch of the readable row after it, or with the last batch."""
    queue = iter(rows)
    for batch in batches:
        paired = []
        for result in batch:
            row = next(queue)
            while row.error is not None:
                paired.append((row, {"error": row.error}))
                row = next(queue)
            paired.append((row, result))
        yield paired
    rest = [(row, {"error": row.error}) for row in queue]
    if rest:
        yield rest


def _line(row: InputRow, result: dict, failed: list[int]) -> str:
    """The JSONL line of ``row``; its warnings go to stderr, its number to ``failed`` when it has an error.

    NaN and infinity are refused (``ValueError``) rather than written: they are not JSON.
    """
    for message in result.get("warnings", []):
        print(f"vlfuse: warning: line {row.line}: {message}", file=sys.stderr)
    if "error" in result:
        result = {**result, "error": f"line {row.line}: {result['error']}"}
        failed.append(row.line)
    return json.dumps({"line": row.line, **row.fields, **result}, allow_nan=False) + "\n"
