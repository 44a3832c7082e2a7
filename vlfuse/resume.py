"""Resuming training where it stopped: ``last.ckpt`` every epoch, random generators in checkpoints,
a checkpoint on SIGTERM."""

from __future__ import annotations

import os
import random
import sys
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info
from lightning.pytorch.utilities.exceptions import SIGTERMException

SIGTERM_EXIT_CODE = 143
"""Exit status of ``vlfuse fit`` stopped by SIGTERM (128 + 15, the shell's convention)."""


def default_checkpoint_dir(run_dir: str | os.PathLike | None) -> str:
    """``<run_dir>/checkpoints``: a run's checkpoints (``vlfuse fit`` passes its run folder, see
    :mod:`vlfuse.runs`; without one, Lightning's ``<trainer.default_root_dir>/checkpoints``)."""
    return os.path.join(run_dir or os.getcwd(), "checkpoints")


def best_checkpoint(folder: Path) -> Path | None:
    """The best checkpoint in ``folder``, as ModelCheckpoint's state in the newest ``last*.ckpt`` there
    names it (``--ckpt_path best`` of a ``validate`` or ``test`` run); ``None`` if none is named or found."""
    lasts = sorted(folder.glob("last*.ckpt"), key=lambda path: path.stat().st_mtime)
    if not lasts:
        return None
    states = torch.load(lasts[-1], map_location="cpu", weights_only=True, mmap=True).get("callbacks", {})
    named = [state["best_model_path"] for state in states.values() if isinstance(state, dict) and state.get("best_model_path")]
    best = folder / Path(named[0]).name if named else None
    return best if best is not None and best.is_file() else None


def rng_state() -> dict:
    """The state of every global random generator: torch (CPU and each CUDA device), numpy, Python.

    Plain types and tensors only, so checkpoints keep loading with ``torch.load(weights_only=True)``.
    """
    _, keys, position, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": random.getstate(),
    }


def set_rng_state(state: dict) -> None:
    """Restore the generators from :func:`rng_state`'s result."""
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    numpy = state["numpy"]
    keys = numpy["keys"].numpy().astype(np.uint32)
    np.random.set_state(("MT19937", keys, numpy["position"], numpy["has_gauss"], numpy["cached_gaussian"]))
    random.setstate(state["python"])


def _all_ranks(state: dict) -> list[dict]:
    """``state`` of every rank, in rank order (a collective call under DDP: every rank must make it)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    states: list = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


class BestAndLastCheckpoint(ModelCheckpoint):
    """Lightning's ModelCheckpoint, with ``last.ckpt`` rewritten at the end of every epoch.

    With a monitor (``val/acc``) and ``save_last``, Lightning 2.6 writes ``last.ckpt`` only in an
    epoch that also saved a best checkpoint, so ``--ckpt_path last`` would go back to the best
    epoch and train the later ones again. This writes it after every epoch whose end saved
    nothing, as ``save_last`` promises (it uses ModelCheckpoint's own private save, as pinned in
    constraints.txt).
    """

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_missing(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._save_last_if_missing(trainer)

    def _save_last_if_missing(self, trainer: L.Trainer) -> None:
        if self.save_last and not self._should_skip_saving_checkpoint(trainer) and self._last_global_step_saved != trainer.global_step:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


class ResumeTraining(Callback):
    """Make a resumed run continue exactly as the uninterrupted one.

    Lightning's checkpoints hold the model, the optimizer, the learning-rate schedule, the loop
    counters (and with them the loggers' step) and the callbacks' state; the training loader
    (:class:`vlfuse.data.resumable.ResumableDataLoader`) adds the data order and the place in the
    epoch. This callback adds the rest:

    - every global random generator of every rank (dropout masks, augmentations), saved in each
      checkpoint and restored when training starts again;
    - on SIGTERM (what a cluster scheduler sends before it stops a job), ``last.ckpt`` in the
      ModelCheckpoint's folder, written after the batch in progress (through the trainer's
      CheckpointIO: :class:`vlfuse.checkpoint_io.AtomicCheckpointIO` under ``vlfuse fit``); ``vlfuse
      fit ... --ckpt_path last`` resumes from it;
    - on Ctrl-C during ``fit``, a line that names the last checkpoint and says how to resume
      (:func:`interrupted`);
    - the training loader's saved place, applied when training starts: Lightning 2.6 drops it when
      ``configure_optimizers`` reads ``trainer.estimated_stepping_batches``, as ours does (Lightning
      issue #20550); with a Lightning that applies it, this is a no-op.
    """

    def __init__(self) -> None:
        self._rng_to_restore: list[dict] | None = None

    def state_dict(self) -> dict:
        return {"rng": _all_ranks(rng_state())}

    def load_state_dict(self, state_dict: dict) -> None:
        self._rng_to_restore = state_dict.get("rng")

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        fit_loop = trainer.fit_loop
        if getattr(fit_loop, "_combined_loader_states_to_load", None):
            fit_loop._load_combined_loader_states()
        if self._rng_to_restore:
            # The same world size gives every rank its own generators back.
            set_rng_state(self._rng_to_restore[trainer.global_rank % len(self._rng_to_restore)])
            self._rng_to_restore = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        if isinstance(exception, SIGTERMException):
            path = last_checkpoint_path(trainer)
            trainer.save_checkpoint(path)
            rank_zero_info(
                f"vlfuse: stopped by SIGTERM at step {trainer.global_step}; saved {path}: "
                "resume with the same command and --ckpt_path last"
            )
        elif isinstance(exception, KeyboardInterrupt) and trainer.state.fn == TrainerFn.FITTING and trainer.is_global_zero:
            print(f"vlfuse: {interrupted(trainer)}", file=sys.stderr)


def last_checkpoint_path(trainer: L.Trainer) -> str:
    """``last.ckpt`` in the folder of the trainer's ModelCheckpoint (default :func:`default_checkpoint_dir`)."""
    checkpoint = trainer.checkpoint_callback
    folder = checkpoint.dirpath if isinstance(checkpoint, ModelCheckpoint) and checkpoint.dirpath else None
    folder = folder or default_checkpoint_dir(trainer.default_root_dir)
    return os.path.join(folder, ModelCheckpoint.CHECKPOINT_NAME_LAST + ModelCheckpoint.FILE_EXTENSION)


def interrupted(trainer: L.Trainer) -> str:
    """What Ctrl-C during ``fit`` leaves: the last checkpoint and how to resume from it.

    No checkpoint is saved at the interrupt itself: Ctrl-C can land in the middle of an optimizer
    step. SIGTERM stops after the batch in progress and saves one there.
    """
    path = last_checkpoint_path(trainer)
    step = f"interrupted (Ctrl-C) at step {trainer.global_step}"
    if not os.path.isfile(path):
        return f"{step}, before any checkpoint was saved: nothing to resume"
    return (
        f"{step}; the last checkpoint is {path}: resume with the same command and --ckpt_path last "
        "(docs/resume.md; kill -TERM <pid> instead of Ctrl-C saves one at the current step)"
    )
