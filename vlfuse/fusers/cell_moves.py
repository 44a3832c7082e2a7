"""The cell-moves reader: the cell-steps reader whose kept set can move one cell, as the word says.

In the cell-steps reader a word moves the set only through the update's candidate, which the shared
block computes from each cell's neighbourhood; nothing makes that move exact, and nothing makes it
give up the cells it came from. Here what the update gate keeps is the set shifted by the word: a
convex mix of the nine one-cell shifts (the neighbourhood), ``softmax(W word)``, as a Neural
Turing Machine shifts its read head, so a relation word can move the whole set and keep nothing of
where it was. Trained on SHAPES it composes on seeds where the cell-steps reader did not.

A shift that reads the word alone gives "of" one move for "left of" and "right of" both: on a
stalled seed "of" took the horizontal move, half left and half right, and "left" and "right" stayed
put. With ``shift_reads: word_and_previous`` the shift also reads the word before it, so "of" after
"right" can move right (docs/results.md, issue 38). But an added term for the word before lets a
frequent word hold still every word after it: on a stalled seed "shape", which comes before every
relation, pushed the next word to "no shift" by about 6 logits and no relation word ever moved. With
``shift_reads: word_steered_by_previous`` the word alone decides how much of the set moves, and the
word before only where it goes.

With ``shift_kernel: displacement`` a word does not weigh the nine shifts one by one: it gives one
displacement ``mu`` (rows, columns) and a sharpness ``c``, and the kept set moves by a Gaussian
around ``mu`` on the neighbourhood: ``p_k`` proportional to ``exp(-c |step_k - mu|^2)``, ``c`` bounded
below. A mix can lower its weight on "no shift" for "left of" and for "right of" at once,
and so "of", pulled off "no shift" by both, can move half of the set each way (seed 5); a
displacement is pulled left and right by as much, and cannot spread much wider than it starts, so
the relation words, each pulled one way, move first: on SHAPES "left" and "right" took the
horizontal moves and "of" kept "no shift" on all ten seeds (docs/results.md, issue 38).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from vlfuse.fusers.base import FUSERS
from vlfuse.fusers.cell_steps import NEIGHBOURHOOD, CellStepsConfig, CellStepsFuser

STAY = NEIGHBOURHOOD * NEIGHBOURHOOD // 2
"""Index of "no shift" among the nine shifts (:meth:`CellMovesFuser.shift_steps`)."""
STAY_BIAS = 4.0
"""Initial logit of "no shift" (the others start at 0): 0.87 of the kept set stays where it is, so
the reader starts as the cell-steps reader does, and each one-cell shift gets 0.016, enough
gradient to be found."""


def previous_added(own: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """``word_and_previous``: the word's shift logits ``(Bq, 9)`` plus the word before's."""
    return own + previous


def previous_steers(own: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """``word_steered_by_previous``: log-probabilities ``(Bq, 9)`` whose weight on no shift is the
    word's own (``softmax(own)``'s), the rest shared among the eight moves as ``own + previous`` says."""
    moves, steer = (torch.cat([x[:, :STAY], x[:, STAY + 1:]], dim=1) for x in (own, previous))  # (Bq, 8)
    log_moves = (moves + steer).log_softmax(-1) + moves.logsumexp(-1, keepdim=True)
    log_stay = own[:, STAY:STAY + 1]
    return torch.cat([log_moves[:, :STAY], log_stay, log_moves[:, STAY:]], dim=1) - own.logsumexp(-1, keepdim=True)


READS_PREVIOUS = {"word_and_previous": previous_added, "word_steered_by_previous": previous_steers}
"""How each ``shift_reads`` that reads the word before combines it with the word's own logits."""

LEAST_SHARPNESS = 2.65
"""The least ``c`` of a displacement's Gaussian, ``exp(-c |step - mu|^2)``; ``c = 2.65 + softplus(v)``
starts at 3.34 (``v = 0``), where the set keeps 0.87 at ``mu = 0``, as the mix's :data:`STAY_BIAS`
starts; at the least ``c`` the set keeps 0.77 (a mix can keep nothing): no word can move most of
the set both ways. A sharper ``c`` moves it exactly, or keeps it exactly."""


class MixKernel:
    """``shift_kernel: mix``: a logit per shift, ``softmax(W word)``, "no shift" starting at
    :data:`STAY_BIAS`."""

    outputs = NEIGHBOURHOOD * NEIGHBOURHOOD

    @staticmethod
    def start(bias: torch.Tensor) -> None:
        bias.zero_()
        bias[STAY] = STAY_BIAS

    @staticmethod
    def log_weights(logits: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """``(Bq, 9)`` logits -> log-weights ``(Bq, 9)``."""
        return logits.log_softmax(-1)


class DisplacementKernel:
    """``shift_kernel: displacement``: ``W word = (2 c mu, v)``, a Gaussian around the displacement
    ``mu`` of sharpness ``c = LEAST_SHARPNESS + softplus(v)``: ``softmax(2 c mu . step - c |step|^2)``."""

    outputs = 3

    @staticmethod
    def start(bias: torch.Tensor) -> None:
        bias.zero_()

    @staticmethod
    def log_weights(logits: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """``(Bq, 3)`` ``(2 c mu, v)`` and the steps ``(9, 2)`` -> log-weights ``(Bq, 9)``: ``-c |step - mu|^2``
        less ``c |mu|^2``, the same for every step."""
        sharpness = LEAST_SHARPNESS + F.softplus(logits[:, 2:])  # (Bq, 1)
        return (logits[:, :2] @ steps.T - sharpness * steps.square().sum(-1)).log_softmax(-1)


SHIFT_KERNELS = {"mix": MixKernel, "displacement": DisplacementKernel}
"""The ``shift_kernel`` options: how a word's outputs become its weights over the nine shifts."""


@FUSERS.register
@dataclass
class CellMovesConfig(CellStepsConfig):
    """The cell-moves reader (``type: cell_moves``): :class:`~vlfuse.fusers.CellStepsConfig` whose
    kept set is shifted by the word (:class:`CellMovesFuser`). The same options, and:

    Attributes:
        shift_reads: what chooses a word's shift: ``word``, the word alone; ``word_and_previous``,
            the word and the word before it in the question; ``word_steered_by_previous``, the word
            alone for how much of the set moves, the word and the one before it for where it goes
            (the word before cannot hold a word still). The word before's weights start at zero, so
            the reader starts as with ``word``.
        shift_kernel: how a word shifts the kept set: ``mix``, a distribution over the nine one-cell
            shifts, ``softmax(W word)``; ``displacement``, one displacement ``mu`` and sharpness
            ``c`` per word, the set moved by a Gaussian around ``mu`` (it cannot move half of the
            set one way and half the other). ``word_steered_by_previous`` steers a mix only.
    """

    type: str = "cell_moves"
    shift_reads: Literal["word", "word_and_previous", "word_steered_by_previous"] = "word"
    shift_kernel: Literal["mix", "displacement"] = "mix"  # a key of SHIFT_KERNELS

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.shift_kernel == "displacement" and self.shift_reads == "word_steered_by_previous":
            raise ValueError("fuser.shift_reads: word_steered_by_previous shares a mix's moves; "
                             "with shift_kernel: displacement use word or word_and_previous")

    def build(self, dim: int, *, text_width: int, grid_size: tuple[int, int]) -> "CellMovesFuser":
        return CellMovesFuser(self, dim, text_width=text_width, grid_size=grid_size)


class CellMovesFuser(CellStepsFuser):
    """:class:`~vlfuse.fusers.CellStepsFuser` whose update reads ``m <- (1 - g) S_w(m) + g c``.

    ``S_w(m)`` is the set shifted by the word: each cell takes ``sum_k p_k m[cell + offset_k]`` over
    the nine offsets of its neighbourhood (nothing comes from beyond the grid's edge), with
    ``p = softmax(W word)`` one distribution per word, whatever the image (``softmax(W word + V
    previous word)`` with ``shift_reads: word_and_previous``; with ``word_steered_by_previous``,
    ``p_stay`` is ``softmax(W word)``'s and the moves share the rest as ``softmax(W word + V previous
    word)`` over the eight moves). With ``shift_kernel: displacement``, ``W word = (2 c mu, v)`` and
    ``p = softmax(2 c mu . step - c |step|^2)`` over the nine steps, ``c = 2.65 + softplus(v)``: a
    Gaussian around the displacement ``mu`` (``V previous word`` added to ``W word`` with
    ``word_and_previous``). One offset that takes all the weight
    moves the whole set exactly, as "right of" asks; "no shift" keeps it, as the cell-steps reader
    does. Everything else (finds, the shared block, the gate) is the cell-steps reader's.

    Args: as :class:`~vlfuse.fusers.CellStepsFuser`.
    """

    def __init__(self, config: CellMovesConfig, dim: int, *, text_width: int, grid_size: tuple[int, int]) -> None:
        super().__init__(config, dim, text_width=text_width, grid_size=grid_size)
        self.kernel = SHIFT_KERNELS[config.shift_kernel]
        self.shift = nn.Linear(text_width, self.kernel.outputs)
        with torch.no_grad():
            self.kernel.start(self.shift.bias)
        self.register_buffer("steps", torch.tensor(self.shift_steps(), dtype=torch.float32), persistent=False)  # (9, 2)
        self.shift_previous, self.read_previous = None, READS_PREVIOUS.get(config.shift_reads)
        if self.read_previous is not None:  # zeros: draws nothing from the random generator
            self.shift_previous = nn.Parameter(torch.zeros(self.kernel.outputs, text_width))

    def _shift_logits(self, text: torch.Tensor, t: int) -> torch.Tensor:
        """What the shift layer gives word ``t`` of ``text`` ``(Bq, Lt, width)``: ``(Bq, outputs)``
        of its kernel (:data:`SHIFT_KERNELS`; :data:`READS_PREVIOUS` says how the word before counts)."""
        own = self.shift(text[:, t])
        if self.shift_previous is None or t == 0:
            return own
        return self.read_previous(own, F.linear(text[:, t - 1], self.shift_previous))

    def _log_shift(self, text: torch.Tensor, t: int) -> torch.Tensor:
        """Log of word ``t``'s weights ``(Bq, 9)`` over the nine shifts, in :meth:`shift_steps` order."""
        logits = self._shift_logits(text, t)
        return self.kernel.log_weights(logits, self.steps.to(logits.dtype))

    def shifts(self, text: torch.Tensor) -> torch.Tensor:
        """Each word's distribution over the nine shifts as the reader applies it in its question:
        ``(Bq, Lt, width) -> (Bq, Lt, 9)``, in :meth:`shift_steps` order."""
        return torch.stack([self._log_shift(text, t) for t in range(text.shape[1])], dim=1).exp()

    @staticmethod
    def shift_steps() -> list[tuple[int, int]]:
        """``(rows, cols)`` by which each shift moves the set: a cell reads the cell at offset
        ``(dr, dc)`` of its neighbourhood, so the set moves by ``(-dr, -dc)``."""
        half = NEIGHBOURHOOD // 2
        return [(-dr, -dc) for dr in range(-half, half + 1) for dc in range(-half, half + 1)]

    def _kept(self, log_m: torch.Tensor, text: torch.Tensor, t: int) -> torch.Tensor:
        """``log S_w(m)`` ``(Bq, cells)`` from ``log m`` ``(Bq, cells)`` as word ``t`` of ``text`` ``(Bq, Lt, width)`` is read."""
        log_0 = torch.finfo(log_m.dtype).min  # beyond the edge; finite so that gradients stay finite
        neighbours = self._neighbourhood(log_m, beyond_edge=log_0)  # (Bq, cells, 9)
        log_shift = self._log_shift(text, t)  # (Bq, 9)
        return torch.logsumexp(neighbours + log_shift[:, None, :], dim=-1)
