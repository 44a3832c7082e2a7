"""The existence head: two answer scores from a reader's evidence that a set is not empty."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import nn

from vlfuse.heads.base import HEADS, Head, HeadConfig
from vlfuse.parts import EVIDENCE


@HEADS.register
@dataclass
class ExistenceConfig(HeadConfig):
    """The existence head (``type: existence``): two answers, for the SHAPES readers
    (``fuser: {type: map_program}``, ``{type: cell_steps}`` or ``{type: cell_moves}``)."""

    type: str = "existence"
    reads = EVIDENCE

    def check(self, answers: Sequence[str]) -> None:
        if len(answers) != 2:
            raise ValueError(f"head 'existence' answers existence questions with two answers (e.g. false/true), got {len(answers)}")

    def build(self, dim: int, answers: Sequence[str]) -> "ExistenceHead":
        return ExistenceHead()


class ExistenceHead(Head):
    """Two answer scores from the evidence: ``[0, evidence + bias]``.

    The second answer of the vocabulary (``true`` of false/true, ``yes`` of no/yes) means "the set
    is not empty". The evidence enters with a fixed scale of 1: a learnt scale can shrink to 0
    while the evidence is still uninformative early in training, after which nothing upstream
    receives a gradient (seen on SHAPES: training stuck at the majority answer).
    """

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(1))

    def forward(self, fused: torch.Tensor, text_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``(Bq,)`` evidence -> ``(Bq, 2)`` answer scores."""
        return torch.stack([torch.zeros_like(fused), fused + self.bias], dim=-1)

    def extend_answers(self, count: int) -> None:
        raise ValueError(
            "head 'existence' scores exactly two answers (is the set empty or not): it cannot add answers; "
            "fine-tune on data with its two answers"
        )
