"""Accuracy of a saved model over a data loader, split into groups of questions."""

from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable, Iterable

import torch

from vlfuse.model import VLFuseModel


def accuracy_by_group(
    model: VLFuseModel, batches: Iterable[dict], group_of: Callable[[int, str], Hashable]
) -> tuple[Counter, Counter]:
    """``(correct, total)`` per group; ``group_of(row, question)`` names the group of each question.

    ``row`` counts the questions in loader order, from 0; ``batches`` come from
    :func:`vlfuse.data.collate_grouped`.
    """
    correct, total = Counter(), Counter()
    row = 0
    with torch.inference_mode():
        for batch in batches:
            tokens = model.tokenize(batch["questions"])
            predicted = model(batch["pixel_values"], **tokens, image_index=batch["image_index"]).logits.argmax(-1)
            for question, guess, label in zip(batch["questions"], predicted.tolist(), batch["labels"].tolist()):
                group = group_of(row, question)
                total[group] += 1
                correct[group] += guess == label
                row += 1
    return correct, total


def accuracy_table(
    correct: Counter, total: Counter, *, group: str, accuracy: str, align: str, overall_digits: int
) -> str:
    """A Markdown table: one row per group (sorted), then an ``all`` row.

    Args:
        group, accuracy: headers of the first and last columns.
        align: the first column's alignment row cell, e.g. ``":---"``.
        overall_digits: decimals of the ``all`` row's percentage.
    """
    lines = [f"| {group} | questions | {accuracy} |", f"|{align}|---:|---:|"]
    for group in sorted(total):
        lines.append(f"| {group} | {total[group]} | {correct[group] / total[group]:.1%} |")
    overall = sum(correct.values()) / sum(total.values())
    lines.append(f"| all | {sum(total.values())} | {overall:.{overall_digits}%} |")
    return "\n".join(lines)
