"""Accuracy of a saved model over a data loader, split into groups of questions."""

from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable, Iterable

import torch

from vlfuse.analysis.tables import markdown_table
from vlfuse.model import VLFuseModel


def accuracy_by_group(
    model: VLFuseModel, batches: Iterable[dict], group_of: Callable[[int, str], Hashable]
) -> tuple[Counter, Counter]:
    """``(correct, total)`` per group; ``group_of(row, question)`` names the group of each question.

    ``row`` counts the questions in loader order, from 0; ``batches`` come from
    :func:`vlfuse.data.collate_grouped` and are moved to the model's device.
    """
    correct, total = Counter(), Counter()
    row = 0
    device = next(model.parameters()).device
    with torch.inference_mode():
        for batch in batches:
            predicted = model(**model.processor.batch(batch, device)).logits.argmax(-1)
            for question, guess, label in zip(batch["questions"], predicted.tolist(), batch["labels"].tolist()):
                group = group_of(row, question)
                total[group] += 1
                correct[group] += guess == label
                row += 1
    return correct, total


def accuracy_table(correct: Counter, total: Counter, *, group: str, accuracy: str, digits: int = 1) -> str:
    """A Markdown table: one row per group (sorted), then an ``all`` row.

    Args:
        group, accuracy: headers of the first and last columns.
        digits: decimals of the percentages.
    """
    rows = [[name, total[name], correct[name] / total[name]] for name in sorted(total)]
    rows.append(["all", sum(total.values()), sum(correct.values()) / sum(total.values())])
    return markdown_table([group, "questions", accuracy], rows, formats=[None, None, f"{{:.{digits}%}}"])
