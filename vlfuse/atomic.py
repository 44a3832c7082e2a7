"""What atomic writers share: flushing to disk, and the leftovers of writers that were killed.

A writer (:func:`vlfuse.model_io.write_model_folder`, :class:`vlfuse.checkpoint_io.AtomicCheckpointIO`)
writes beside its target under a hidden name that carries its process id, then renames onto the
target. A process killed in between leaves that hidden file or folder behind;
:func:`remove_abandoned` removes those whose process no longer runs.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import BinaryIO, Callable


def process_running(pid: int) -> bool:
    """Whether a process ``pid`` runs on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        return True
    return True


def remove_abandoned(folder: Path, prefix: str) -> None:
    """Remove the entries of ``folder`` named ``<prefix><pid>...`` (files or folders) whose process
    ``pid`` no longer runs; this process's own are kept."""
    for entry in folder.glob(f"{prefix}*"):
        pid = entry.name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or process_running(int(pid)):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)


def give_default_permissions(path: Path) -> None:
    """Give the file ``path`` the permissions of any new file under this process's umask (safetensors
    creates its files readable by their owner only: a model folder is meant to be shared)."""
    umask = os.umask(0o022)  # reading the umask sets it: put it back at once
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def fsync(path: Path) -> None:
    """Flush the file or folder ``path`` to disk (a folder: the renames in it); a no-op where folders
    cannot be opened (Windows)."""
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def replace_file(target: Path, temp: Path, write: Callable[[BinaryIO], None]) -> None:
    """``write(file)`` into ``temp`` (beside ``target``), flush it to disk and rename it onto ``target``
    (``os.replace``: atomic on one filesystem), so that a kill leaves the old file or the new one. On
    any exception ``temp`` is removed and ``target`` is left as it was."""
    try:
        with open(temp, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp, target)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    fsync(target.parent)
