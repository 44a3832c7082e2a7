"""Evaluation metrics that torchmetrics does not have: VQA's soft accuracy."""

from __future__ import annotations

import torch
from torchmetrics import Metric

from vlfuse.data.dataset import NO_ANSWER
from vlfuse.data.vqa_v2 import soft_accuracy


class VQASoftAccuracy(Metric):
    """VQA v2's soft accuracy of predicted answers against every annotator's answer.

    ``update(preds, human_labels)``: ``preds`` are logits ``(Bq, C)`` or class indices ``(Bq,)``;
    ``human_labels`` ``(Bq, A)`` are the class index of each human answer, padded with
    :data:`~vlfuse.data.dataset.NO_ANSWER` (see :func:`vlfuse.data.dataset.human_labels`); a human
    answer outside the vocabulary (:data:`~vlfuse.data.IGNORE_INDEX`) counts as an annotator no
    prediction matches. Questions without any human answer are left out. ``compute()`` is the mean
    over questions (0 before any question).
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.add_state("score", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("questions", default=torch.tensor(0), dist_reduce_fx="sum")

    def update(self, preds: torch.Tensor, human_labels: torch.Tensor) -> None:
        if preds.ndim == 2:
            preds = preds.argmax(dim=-1)
        given = human_labels != NO_ANSWER  # (Bq, A)
        humans = given.sum(dim=1)
        matches = ((human_labels == preds[:, None]) & given).sum(dim=1)
        answered = humans > 0
        self.score += soft_accuracy(matches[answered], humans[answered]).sum()
        self.questions += answered.sum()

    def compute(self) -> torch.Tensor:
        return (self.score / self.questions.clamp(min=1)).float()
