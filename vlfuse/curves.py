"""A run's training curves: its CSV logs read as one history and drawn as one PNG.

A run folder (:mod:`vlfuse.runs`) logs into ``metrics.csv``, and each continuation of the run into
``resume_K/metrics.csv``; :func:`draw_run_curves` draws them all into ``<run>/curves.png``: the losses
(training per step and per epoch, validation per epoch), the accuracies, and a caption model's scores.
``vlfuse plot RUN`` and, at the end of ``fit``, :class:`vlfuse.callbacks.EpochSummary` call it.

Light on purpose (the standard library and matplotlib's Agg canvas, no global backend changed):
``vlfuse plot`` loads neither torch nor Lightning.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from vlfuse.runs import RESUME_PREFIX

METRICS_FILE = "metrics.csv"
CURVES_FILE = "curves.png"
PANELS = ("loss", "accuracy", "caption scores", "CIDEr-D")
"""The panels of the figure, in order; a panel without a curve is left out."""
CAPTION_SCORES = ("bleu4", "fact_precision", "object_recall")
"""The caption metrics on a 0-1 scale (CIDEr-D, up to 10, has a panel of its own)."""

Row = dict[str, float]
Curve = tuple[list[float], list[float]]


def resume_number(path: Path) -> int:
    """K of ``<run>/resume_K/metrics.csv``."""
    return int(path.parent.name[len(RESUME_PREFIX):])


def metrics_files(folder: Path) -> list[Path]:
    """The CSV logs of the run ``folder`` in the order they were written: ``metrics.csv``, then
    ``resume_1/metrics.csv``, ``resume_2/metrics.csv``, ... (those that exist)."""
    parts = [
        path for path in folder.glob(f"{RESUME_PREFIX}*/{METRICS_FILE}")
        if path.parent.name[len(RESUME_PREFIX):].isdigit() and path.is_file()
    ]
    first = [folder / METRICS_FILE] if (folder / METRICS_FILE).is_file() else []
    return first + sorted(parts, key=resume_number)


def number(text: str | None) -> float | None:
    """A CSV cell as a number; ``None`` for an empty cell or one a killed writer cut short."""
    try:
        return float(text) if text else None
    except ValueError:
        return None


def read_rows(path: Path) -> list[Row]:
    """The rows of one CSV log with a ``step``, each with its numeric cells only."""
    with path.open(newline="") as file:
        rows = [{key: value for key, text in row.items() if key and (value := number(text)) is not None}
                for row in csv.DictReader(file)]
    return [row for row in rows if "step" in row]


def run_history(paths: Sequence[Path]) -> list[Row]:
    """The rows of a run's logs (:func:`metrics_files`) as one history: a continued part replaces the
    earlier parts' rows from its first step on (the steps a killed part logged after its last
    checkpoint were trained again)."""
    history: list[Row] = []
    for path in reversed(paths):
        rows = read_rows(path)
        start = min((row["step"] for row in history), default=float("inf"))
        history = [row for row in rows if row["step"] < start] + history
    return history


def panel_of(column: str) -> str | None:
    """The panel (:data:`PANELS`) of a logged column, or ``None`` for one not drawn (the test split,
    counts, learning rates, gradient norms, ...)."""
    stage, _, metric = column.partition("/")
    if stage in ("test", "epoch", "step") or not metric:
        return None
    if metric.startswith("loss"):
        return "loss"
    if "acc" in metric or stage == "val_group":
        return "accuracy"
    if metric in CAPTION_SCORES:
        return "caption scores"
    return "CIDEr-D" if metric == "cider" else None


def curves(rows: Sequence[Row]) -> dict[str, dict[str, Curve]]:
    """``{panel: {column: (steps, values)}}`` of every drawn column of ``rows``."""
    found: dict[str, dict[str, Curve]] = {}
    for row in rows:
        for column, value in row.items():
            panel = panel_of(column)
            if panel is not None:
                steps, values = found.setdefault(panel, {}).setdefault(column, ([], []))
                steps.append(row["step"])
                values.append(value)
    return {panel: dict(sorted(found[panel].items())) for panel in PANELS if panel in found}


def draw_curves(rows: Sequence[Row], path: Path, title: str = "") -> Path:
    """Draw the curves of ``rows`` (:func:`curves`) over the optimiser steps, one panel each, into the
    PNG ``path``; per-step values as a thin line, per-epoch values as points. Returns ``path``.

    Raises:
        ValueError: ``rows`` hold no curve (nothing logged yet).
    """
    panels = curves(rows)
    if not panels:
        raise ValueError(f"nothing to draw into {path}: the logs hold no loss, accuracy or caption score yet")
    figure = Figure(figsize=(5.0 * len(panels), 4.0))
    FigureCanvasAgg(figure)
    for i, (name, columns) in enumerate(panels.items()):
        ax = figure.add_subplot(1, len(panels), i + 1)
        for column, (steps, values) in columns.items():
            per_step = column.endswith("_step")
            ax.plot(steps, values, label=column, linewidth=0.8 if per_step else 1.5,
                    alpha=0.6 if per_step else 1.0, marker="" if per_step else "o", markersize=3)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    figure.suptitle(title, fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    return path


def draw_run_curves(folder: Path, out: Path | None = None) -> Path:
    """Draw the curves of the run ``folder`` (all its logs, :func:`run_history`) into ``out`` (default
    ``<folder>/curves.png``); returns where.

    Raises:
        FileNotFoundError: ``folder`` has no CSV log; the message names the files looked for.
        ValueError: the logs hold nothing to draw.
    """
    paths = metrics_files(folder)
    if not paths:
        raise FileNotFoundError(
            f"no training log in {folder}: looked for {folder / METRICS_FILE} and "
            f"{folder / (RESUME_PREFIX + 'K') / METRICS_FILE} (a run folder of a fit with a CSV logger, e.g. runs/easy_vqa/latest)"
        )
    return draw_curves(run_history(paths), out or folder / CURVES_FILE, title=str(folder))
