"""Text->image attention drawn over the image, one panel per head plus the head average.

The weights of one query (a question token, or the pooled question) over the image tokens are
split into the prefix tokens (CLS, registers), which have no place on the image, and the patch
tokens, which are laid out on the patch grid and drawn over the image as the model saw it.
Figures are drawn with matplotlib's Agg canvas directly, so no global backend is changed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from vlfuse.readouts import masked_mean


def select_query(weights: torch.Tensor, text_mask: torch.Tensor, token: int | None = None) -> torch.Tensor:
    """The attention of one query of one pair: ``(H, Lt, Li) -> (H, Li)``.

    Args:
        weights: cross-attention weights of one pair, every question token over every image token.
        text_mask: ``(Lt,)`` True for real (non-padding) question tokens.
        token: a token position, or ``None`` for the pooled question: the mean over real tokens,
            the pooling of the ``pool`` readout (:func:`vlfuse.readouts.masked_mean`). A mean of
            distributions is a distribution, so the rows still sum to 1 over the image tokens.
    """
    if token is not None:
        return weights[:, token]
    return masked_mean(weights, text_mask.expand(weights.shape[0], -1))  # (H, Li): each head's rows are its batch


def split_prefix(
    weights: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Split ``(N, prefix + rows * cols)`` weights into patch maps ``(N, rows, cols)`` and prefix mass ``(N,)``."""
    rows, cols = grid
    expected = num_prefix_tokens + rows * cols
    if weights.shape[-1] != expected:
        raise ValueError(
            f"weights cover {weights.shape[-1]} image tokens, but {num_prefix_tokens} prefix tokens and a "
            f"{rows}x{cols} grid make {expected}"
        )
    prefix_mass = weights[:, :num_prefix_tokens].sum(-1)  # (N,)
    maps = weights[:, num_prefix_tokens:].reshape(-1, rows, cols)  # (N, rows, cols), row-major like the ViT
    return maps, prefix_mass


def draw_attention_map(
    image: np.ndarray,
    weights: torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int,
    path: str | Path,
    *,
    head_ids: Sequence[int] | None = None,
    title: str = "",
    columns: int = 6,
) -> int:
    """Save a figure with one panel per head and one for the head average; return the panel count.

    Each panel draws the attention to the patch tokens over the image on the patch grid, with one
    colour scale for all panels so that heads can be compared; its title gives the share of the
    attention that went to the prefix tokens instead (not drawn, since they have no position).

    Args:
        image: ``(S, S, 3)`` floats in [0, 1]: the image as the model saw it (after preprocessing).
        weights: ``(H, Li)`` attention of one query over all image tokens, prefix tokens first.
        grid: ``(rows, cols)`` of the patch grid.
        num_prefix_tokens: image tokens before the patch tokens.
        path: where to write the PNG.
        head_ids: a label per head (the original head ids of a pruned layer); default ``0..H-1``.
        title: the figure title.
        columns: panels per row.

    Returns:
        The number of panels (axes) drawn: ``H + 1``.
    """
    weights = torch.as_tensor(weights, dtype=torch.float32)
    labels = [f"head {h}" for h in (range(len(weights)) if head_ids is None else head_ids)] + ["mean of heads"]
    panels = torch.cat([weights, weights.mean(0, keepdim=True)])  # (H + 1, Li)
    maps, prefix_mass = split_prefix(panels, grid, num_prefix_tokens)  # (H + 1, rows, cols), (H + 1,)
    cols = min(columns, len(labels))
    rows = math.ceil(len(labels) / cols)
    figure = Figure(figsize=(1.8 * cols, 1.9 * rows + 0.8))
    FigureCanvasAgg(figure)
    extent = (0, grid[1], grid[0], 0)  # image and heat map share patch coordinates
    vmax = max(float(maps.max()), 1e-12)
    for i, (label, patch_map, prefix) in enumerate(zip(labels, maps, prefix_mass)):
        ax = figure.add_subplot(rows, cols, i + 1)
        ax.imshow(image, extent=extent)
        heat = dict(cmap="inferno", alpha=0.6, vmin=0.0, vmax=vmax, interpolation="nearest")
        ax.imshow(patch_map.numpy(), extent=extent, **heat)
        ax.set_title(f"{label}\nprefix tokens {float(prefix):.0%}", fontsize=7)
        ax.set_axis_off()
    figure.suptitle(f"{title}\ncolour: attention to each patch (one scale, max {vmax:.3f})", fontsize=8)
    figure.savefig(path, dpi=80)
    return len(figure.axes)
