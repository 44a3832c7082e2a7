"""Training diagnostics as Lightning callbacks: what a stalled run needs looked at.

Add them to any config or command line, e.g.::

    vlfuse fit --config configs/easy_vqa.yaml --trainer.callbacks+=vlfuse.callbacks.GroupAccuracy \\
        --trainer.callbacks+=vlfuse.callbacks.GradientNorms

- :class:`GroupAccuracy`: validation accuracy per group of questions, every epoch
  (``val_group/<group>``): per-kind curves show *which* questions a run has not learnt yet;
- :class:`GradientNorms`: the gradient norm of each part of the model (``grad_norm/<part>``): whether
  the image side still gets a training signal while accuracy is flat.

``vlfuse fit`` installs :class:`EpochSummary` itself (``--progress.*``): one line per epoch in a log
file, and the run's curves at the end.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from vlfuse.analysis.grouped_accuracy import accuracy_by_group
from vlfuse.curves import draw_run_curves
from vlfuse.data.easy_vqa import question_kind
from vlfuse.runs import RESUME_PREFIX

MODEL_PARTS = ("image_encoder", "image_proj", "text_encoder", "text_proj", "fuser", "head")
"""The top-level parts of :class:`~vlfuse.model.VLFuseModel` whose gradient norms are logged."""


class GroupAccuracy(Callback):
    """Logs ``val_group/<group>``: the validation accuracy of each group of questions, every epoch.

    It scores the validation loader once more after Lightning's own validation, in eval mode.

    Args:
        group_of: question text -> its group (default: easy-VQA's
            :func:`~vlfuse.data.easy_vqa.question_kind`: "what colour", "yes/no shape negated", ...).
            On the command line, the import path of a function.
    """

    def __init__(self, group_of: Callable[[str], str] = question_kind) -> None:
        self.group_of = group_of

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        correct, total = accuracy_by_group(
            pl_module.model, trainer.datamodule.val_dataloader(), lambda row, question: self.group_of(question)
        )
        for group in sorted(total):
            pl_module.log(f"val_group/{group}", correct[group] / total[group], sync_dist=True)


class GradientNorms(Callback):
    """Logs ``grad_norm/<part>``, the L2 norm of the gradients of each part of the model
    (:data:`MODEL_PARTS`), every ``every_n_steps`` optimiser steps.

    Args:
        every_n_steps: how often to log.
    """

    def __init__(self, every_n_steps: int = 25) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be at least 1, got {every_n_steps}")
        self.every_n_steps = every_n_steps

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer) -> None:
        if trainer.global_step % self.every_n_steps:
            return
        for part in MODEL_PARTS:
            module = getattr(pl_module.model, part, None)
            grads = [] if module is None else [p.grad for p in module.parameters() if p.grad is not None]
            if grads:
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                pl_module.log(f"grad_norm/{part}", norm, on_step=True, on_epoch=False)


# ------------------------------------------------------------------------------ progress in a log file
EPOCH_METRICS = (
    ("train/loss_epoch", "train loss"),
    ("train/acc", "train acc"),
    ("val/acc", "val acc"),
    ("val/soft_acc", "val VQA acc"),
    ("val/bleu4", "val BLEU-4"),
    ("val/cider", "val CIDEr-D"),
    ("val/fact_precision", "val fact precision"),
    ("val/object_recall", "val object recall"),
)
"""``(logged name, label)``: what an epoch's line shows, in order, of the metrics that were logged."""
BEST_OF = ("val/acc", "val/cider")
"""The metrics whose best value so far the line shows too (higher is better)."""


def format_duration(seconds: float) -> str:
    """``41 s``, ``4 min 50 s``, ``2 h 05 min``."""
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


def epoch_line(
    epoch: int, max_epochs: int | None, metrics: Mapping[str, float], best: Mapping[str, float],
    seconds: float, left: float | None,
) -> str:
    """``vlfuse: epoch 3/10: train loss 0.412, train acc 0.871, val acc 0.902 (best 0.902), 41 s, about 4 min 50 s left``.

    Args:
        epoch: the epoch that ended, counted from 1.
        max_epochs: the number of epochs of the run (``None``: not known).
        metrics: the epoch's metrics; those of :data:`EPOCH_METRICS` are shown.
        best: the best value so far of the metrics of :data:`BEST_OF`.
        seconds: how long the epoch took, its validation included.
        left: the estimated time to the end (``None``: not known; 0: nothing is left).
    """
    scores = [
        f"{label} {metrics[name]:.3f}" + (f" (best {best[name]:.3f})" if name in best else "")
        for name, label in EPOCH_METRICS if name in metrics
    ]
    timing = [format_duration(seconds)] + ([f"about {format_duration(left)} left"] if left else [])
    of = f"/{max_epochs}" if max_epochs else ""
    return f"vlfuse: epoch {epoch}{of}: " + ", ".join(scores + timing)


def shows_progress_bar(trainer: L.Trainer, stream: TextIO) -> bool:
    """Whether Lightning's progress bar is on and ``stream`` is a terminal: the bar then shows progress."""
    return trainer.progress_bar_callback is not None and stream.isatty()


def epochs_left(trainer: L.Trainer) -> int | None:
    """The epochs still to train after the current one: to ``max_epochs``, or fewer where ``max_steps``
    ends the run first; ``None`` when neither sets an end."""
    left = None if trainer.max_epochs is None or trainer.max_epochs < 0 else max(trainer.max_epochs - trainer.current_epoch - 1, 0)
    batches = trainer.num_training_batches
    if trainer.max_steps is not None and trainer.max_steps >= 0 and 0 < batches < math.inf:
        steps_per_epoch = math.ceil(batches / trainer.accumulate_grad_batches)
        by_steps = math.ceil(max(trainer.max_steps - trainer.global_step, 0) / steps_per_epoch)
        left = by_steps if left is None else min(left, by_steps)
    return left


def run_folder_of(log_dir: Path) -> Path:
    """The run folder whose logs ``log_dir`` holds: its parent for a continuation's ``resume_K``."""
    return log_dir.parent if log_dir.name.startswith(RESUME_PREFIX) else log_dir


class EpochSummary(Callback):
    """Progress that a log file keeps: on rank 0, one line on standard error at the end of each
    training epoch, after its validation (:func:`epoch_line`), unless Lightning's progress bar shows
    on a terminal; at the end of ``fit``, the run's curves (:func:`vlfuse.curves.draw_run_curves`)
    drawn into ``curves.png`` of the run folder of each CSV logger.

    The best values so far are kept in checkpoints, so a continued run compares with all its epochs;
    the time left is this process's mean epoch time times the epochs left to ``max_epochs``.

    Args:
        lines: print the line of each epoch.
        curves: draw the curves at the end of ``fit``.
    """

    def __init__(self, lines: bool = True, curves: bool = True) -> None:
        self.lines = lines
        self.curves = curves
        self.best: dict[str, float] = {}
        self.started = self.epoch_started = time.monotonic()
        self.epochs_run = 0
        self.validated = False

    def state_dict(self) -> dict[str, Any]:
        return {"best": dict(self.best)}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.best = dict(state_dict["best"])

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.started, self.epochs_run = time.monotonic(), 0

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.epoch_started, self.validated = time.monotonic(), False

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.validated = self.validated or not trainer.sanity_checking

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        now = time.monotonic()
        self.epochs_run += 1
        metrics = {
            name: float(value) for name, value in trainer.callback_metrics.items()
            if self.validated or not name.startswith("val")  # no stale validation scores
        }
        for name in BEST_OF:
            if name in metrics:
                self.best[name] = max(metrics[name], self.best.get(name, metrics[name]))
        if not self.lines or not trainer.is_global_zero or shows_progress_bar(trainer, sys.stderr):
            return
        left = epochs_left(trainer)
        pace = (now - self.started) / self.epochs_run
        line = epoch_line(
            trainer.current_epoch + 1, trainer.max_epochs if left is not None else None, metrics, self.best,
            now - self.epoch_started, None if left is None else pace * left,
        )
        print(line, file=sys.stderr, flush=True)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.curves or not trainer.is_global_zero:
            return
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                logger.save()  # Lightning writes the last rows only after on_fit_end
                try:
                    path = draw_run_curves(run_folder_of(Path(logger.log_dir)))
                except (OSError, ValueError) as err:
                    rank_zero_warn(f"vlfuse: no training curves drawn: {err}")
                else:
                    rank_zero_info(f"vlfuse: training curves in {path} (vlfuse plot RUN draws them again)")
