"""Checkpoints written atomically: a reader, or a run resumed after SIGKILL, finds the old checkpoint
or the new one, whole, never a part of one.

Lightning 2.6's ``TorchCheckpointIO`` serialises a checkpoint to memory and writes it through an
fsspec transaction, whose local file is a ``tempfile.mkstemp()`` in the temporary folder, moved onto
the target with ``shutil.move`` when the transaction commits: a rename when both are on one
filesystem, a copy onto the target otherwise (a scratch or network disk for the checkpoints, a
local ``/tmp``), and a process killed during that copy leaves a truncated checkpoint. Nothing is
fsynced either, so a crash of the machine can leave an empty file under the new name.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.io import TorchCheckpointIO

from vlfuse import atomic

TEMP_INFIX = ".tmp-"
"""A checkpoint is written as ``.<name>.tmp-<pid>`` beside its target: hidden, and not ``last*.ckpt``,
so that ``--ckpt_path last`` never picks up a half-written one."""


def temp_path(target: Path) -> Path:
    """Where this process writes ``target`` before renaming it: ``.<name>.tmp-<pid>``."""
    return target.with_name(f".{target.name}{TEMP_INFIX}{os.getpid()}")


def save_atomically(checkpoint: dict[str, Any], target: Path) -> None:
    """``torch.save(checkpoint)`` to a temporary file in ``target``'s folder, flushed and fsynced, then
    renamed onto ``target`` (``os.replace``: atomic on one filesystem). On any exception the temporary
    file is removed and ``target`` is left as it was."""
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic.remove_abandoned(target.parent, f".{target.name}{TEMP_INFIX}")
    atomic.replace_file(target, temp_path(target), lambda file: torch.save(checkpoint, file))


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO`` whose local checkpoints are written by :func:`save_atomically`.

    ``vlfuse fit | validate | test`` install it (unless ``--trainer.plugins`` or the strategy bring a
    CheckpointIO of their own), so every checkpoint goes through it: ModelCheckpoint's, and the one
    ResumeTraining writes on SIGTERM. Remote paths (``s3://...``) keep Lightning's transaction.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Optional[Any] = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        save_atomically(checkpoint, Path(path))
