"""PNG figures of the head analysis: layer x head heat maps, head agreement, pruning curves.

Drawn on matplotlib's Agg canvas directly (:func:`new_figure`, which
:mod:`vlfuse.analysis.attention_maps` uses too), so no global backend is changed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure


def new_figure(width: float, height: float) -> Figure:
    """A figure of ``width`` x ``height`` inches on its own Agg canvas."""
    figure = Figure(figsize=(width, height))
    FigureCanvasAgg(figure)
    return figure


def draw_layer_head_maps(panels: Mapping[str, np.ndarray], path: str | Path, *, title: str = "") -> None:
    """One heat map per entry of ``panels``: ``name -> (layers, heads)`` values, NaN for pruned heads.

    Each cell is annotated with its value when the grid is small enough to read.
    """
    layers, heads = next(iter(panels.values())).shape
    figure = new_figure(0.45 * heads + 2.0, len(panels) * (0.45 * layers + 0.9) + 0.6)
    annotate = heads * layers <= 16 * 6
    for i, (name, values) in enumerate(panels.items()):
        ax = figure.add_subplot(len(panels), 1, i + 1)
        values = np.asarray(values, dtype=float)
        image = ax.imshow(np.ma.masked_invalid(values), cmap="viridis", aspect="auto", interpolation="nearest")
        figure.colorbar(image, ax=ax, fraction=0.03, pad=0.01)
        ax.set_title(name, fontsize=8)
        ax.set_xticks(range(heads), [str(h) for h in range(heads)], fontsize=6)
        ax.set_yticks(range(layers), [f"layer {layer}" for layer in range(layers)], fontsize=6)
        if annotate:
            low, high = image.get_clim()
            for (layer, head), value in np.ndenumerate(values):
                if math.isfinite(value):
                    bright = high > low and (value - low) / (high - low) > 0.6  # viridis turns yellow
                    colour = "black" if bright else "white"
                    ax.text(head, layer, f"{value:.2f}", ha="center", va="center", fontsize=4.5, color=colour)
    figure.suptitle(title or "per head (columns: original head ids; blank: pruned)", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def draw_agreement(matrices: Sequence[np.ndarray], head_ids: Sequence[Sequence[int]], path: str | Path) -> None:
    """The ``(H, H)`` mean pairwise agreement of each layer's heads, one panel per layer."""
    figure = new_figure(3.6 * len(matrices), 3.4)
    for layer, (matrix, ids) in enumerate(zip(matrices, head_ids)):
        ax = figure.add_subplot(1, len(matrices), layer + 1)
        image = ax.imshow(np.asarray(matrix), cmap="magma", vmin=0.0, vmax=1.0, interpolation="nearest")
        ax.set_xticks(range(len(ids)), [str(h) for h in ids], fontsize=5)
        ax.set_yticks(range(len(ids)), [str(h) for h in ids], fontsize=5)
        ax.set_title(f"layer {layer}: agreement between heads", fontsize=8)
        figure.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def draw_pruning_curves(curves: Mapping[str, Sequence[tuple[float, float]]], path: str | Path) -> None:
    """Accuracy against the fraction of heads pruned, one line per score."""
    figure = new_figure(5.0, 3.4)
    ax = figure.add_subplot(1, 1, 1)
    for name, points in curves.items():
        fractions, accuracies = zip(*points)
        ax.plot(fractions, accuracies, marker="o", markersize=3, label=name)
    ax.set_xlabel("fraction of heads pruned (lowest scores first)")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0.0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=100)
