"""Training diagnostics as Lightning callbacks: what a stalled run needs looked at.

Add them to any config or command line, e.g.::

    vlfuse fit --config configs/easy_vqa.yaml --trainer.callbacks+=vlfuse.callbacks.GroupAccuracy \\
        --trainer.callbacks+=vlfuse.callbacks.GradientNorms

- :class:`GroupAccuracy`: validation accuracy per group of questions, every epoch
  (``val_group/<group>``): per-kind curves show *which* questions a run has not learnt yet;
- :class:`GradientNorms`: the gradient norm of each part of the model (``grad_norm/<part>``): whether
  the image side still gets a training signal while accuracy is flat.
"""

from __future__ import annotations

from typing import Callable

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from vlfuse.analysis.grouped_accuracy import accuracy_by_group
from vlfuse.data.easy_vqa import question_kind

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
