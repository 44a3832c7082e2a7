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

import matplotlib
import numpy as np
import torch
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure

from vlfuse.analysis.figures import new_figure
from vlfuse.heads import masked_mean


def select_query(weights: torch.Tensor, text_mask: torch.Tensor, token: int | None = None) -> torch.Tensor:
    """The attention of one query of one pair: ``(H, Lt, Li) -> (H, Li)``.

    Args:
        weights: cross-attention weights of one pair, every question token over every image token.
        text_mask: ``(Lt,)`` True for real (non-padding) question tokens.
        token: a token position, or ``None`` for the pooled question: the mean over real tokens,
            the pooling of the ``pooled`` and ``bilinear`` heads (:func:`vlfuse.heads.masked_mean`). A mean of
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


HEAT_COLOURS = "inferno"
MAX_OPACITY = 0.85
"""Opacity of the heat map where the attention is highest; it falls linearly to 0 (the bare image) at 0."""


def heat_overlay(patch_map: np.ndarray, vmax: float) -> np.ndarray:
    """RGBA ``(rows, cols, 4)`` colours of a ``(rows, cols)`` map on the scale ``[0, vmax]``.

    The colour encodes the weight, and so does the opacity: a patch without attention is fully
    transparent, so the image shows through unchanged instead of under a dark veil.
    """
    level = np.clip(np.asarray(patch_map, dtype=float) / vmax, 0.0, 1.0)
    rgba = matplotlib.colormaps[HEAT_COLOURS](level)
    rgba[..., 3] = MAX_OPACITY * level
    return rgba


def attention_figure(
    image: np.ndarray,
    weights: torch.Tensor,
    grid: tuple[int, int],
    num_prefix_tokens: int,
    *,
    head_ids: Sequence[int] | None = None,
    title: str = "",
    columns: int = 6,
) -> Figure:
    """The figure that :func:`draw_attention_map` saves: a panel per head, the head average, one colour bar."""
    weights = torch.as_tensor(weights, dtype=torch.float32)
    labels = [f"head {h}" for h in (range(len(weights)) if head_ids is None else head_ids)] + ["mean of heads"]
    panels = torch.cat([weights, weights.mean(0, keepdim=True)])  # (H + 1, Li)
    return overlay_figure(
        image, panels, labels, grid, num_prefix_tokens, title=title, columns=columns,
        bar_label="attention to the patch (one scale for all panels)",
    )


def overlay_figure(
    image: np.ndarray,
    panels: torch.Tensor,
    labels: Sequence[str],
    grid: tuple[int, int],
    num_prefix_tokens: int,
    *,
    title: str = "",
    columns: int = 6,
    bar_label: str,
) -> Figure:
    """One panel per row of ``panels`` ``(N, prefix + rows * cols)``: its patch map over ``image``
    (:func:`heat_overlay`) titled by its label and its share on the prefix tokens, one colour scale
    for all panels, shown by the colour bar (labelled ``bar_label``)."""
    panels = torch.as_tensor(panels, dtype=torch.float32)
    maps, prefix_mass = split_prefix(panels, grid, num_prefix_tokens)  # (N, rows, cols), (N,)
    cols = min(columns, len(labels))
    rows = math.ceil(len(labels) / cols)
    figure = new_figure(1.8 * cols + 0.8, 1.9 * rows + 0.8)
    extent = (0, grid[1], grid[0], 0)  # image and heat map share patch coordinates
    vmax = max(float(maps.max()), 1e-12)
    axes = []
    for i, (label, patch_map, prefix) in enumerate(zip(labels, maps, prefix_mass)):
        ax = figure.add_subplot(rows, cols, i + 1)
        ax.imshow(image, extent=extent)
        ax.imshow(heat_overlay(patch_map.numpy(), vmax), extent=extent, interpolation="nearest")
        ax.set_title(f"{label}\nprefix tokens {float(prefix):.0%}", fontsize=7)
        ax.set_axis_off()
        axes.append(ax)
    scale = ScalarMappable(Normalize(0.0, vmax), matplotlib.colormaps[HEAT_COLOURS])
    bar = figure.colorbar(scale, ax=axes, fraction=0.02, pad=0.02)
    bar.set_label(bar_label, fontsize=7)
    bar.ax.tick_params(labelsize=6)
    figure.suptitle(title, fontsize=8)
    return figure


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

    Each panel draws the attention to the patch tokens over the image on the patch grid (see
    :func:`heat_overlay`), with one colour scale for all panels, shown by the colour bar, so that
    heads can be compared; its title gives the share of the attention that went to the prefix
    tokens instead (not drawn, since they have no position).

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
        The number of panels drawn: ``H + 1`` (the colour bar not counted).
    """
    figure = attention_figure(
        image, weights, grid, num_prefix_tokens, head_ids=head_ids, title=title, columns=columns
    )
    figure.savefig(path, dpi=80)
    return len(weights) + 1
