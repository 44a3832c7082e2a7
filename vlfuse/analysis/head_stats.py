"""What each attention head does: statistics of cross-attention weights, per query and per head.

Every function takes the weights of one fusion layer as ``(N, H, Lk)``: one row per real question
token (the queries), one distribution over the ``Lk`` image tokens per head, the
``num_prefix_tokens`` prefix tokens (CLS, registers) first and then the patch grid in row-major
order. :class:`HeadStatsAccumulator` averages them over a data set without keeping the weights.

Definitions (all averaged over query rows):

- normalised entropy: ``-sum_k p_k log p_k / log Lk`` over all image tokens: 1 for uniform
  attention, 0 for attention on one token;
- top-patch mass: the largest weight on a single patch token (prefix tokens excluded);
- prefix mass: the weight on the prefix tokens together;
- attended distance: the patch weights renormalised to a distribution ``q`` over grid cells; the
  expected Euclidean distance, in grid cells, between an attended cell and the centroid
  ``sum_j q_j pos_j`` of the map (a spatial spread: 0 for one cell, about 1.1 for a uniform 3x3
  neighbourhood);
- object mass: the share of ``q`` on cells that hold an object (:func:`object_cells`); its lift is
  object mass / object area, the share of cells that hold an object (1 for a uniform map);
- pointing: whether the head's largest patch weight falls on a cell that holds an object (the
  pointing game, as ``scripts/pointing_game.py`` plays it for whole questions): its mean is the
  head's hit rate;
- agreement: the Bhattacharyya coefficient ``sum_k sqrt(p_k p'_k)`` of two heads' distributions
  (1 for identical distributions, 0 for disjoint ones), averaged over the other heads of the layer;
- contribution: the norm of a head's share of the attention output, its attention-weighted values
  through its columns of ``out_proj``, relative to the mean over the layer's heads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def _check_weights(weights: torch.Tensor) -> None:
    if weights.dim() != 3:
        raise ValueError(f"weights must be (queries, heads, keys), got shape {tuple(weights.shape)}")


def _patches(weights: torch.Tensor, num_prefix_tokens: int, grid: tuple[int, int] | None = None) -> torch.Tensor:
    """The patch-token part of ``(N, H, Lk)`` weights: ``(N, H, cells)``."""
    _check_weights(weights)
    cells = weights.shape[-1] - num_prefix_tokens
    if cells < 1 or num_prefix_tokens < 0:
        raise ValueError(
            f"{weights.shape[-1]} image tokens leave no patch tokens after {num_prefix_tokens} prefix tokens"
        )
    if grid is not None and grid[0] * grid[1] != cells:
        raise ValueError(
            f"weights cover {weights.shape[-1]} image tokens, but {num_prefix_tokens} prefix tokens and a "
            f"{grid[0]}x{grid[1]} grid make {num_prefix_tokens + grid[0] * grid[1]}"
        )
    return weights[..., num_prefix_tokens:]


def _patch_distribution(weights: torch.Tensor, num_prefix_tokens: int, grid=None) -> torch.Tensor:
    """Patch weights renormalised to sum to 1 per row (all zeros where no weight is on the grid)."""
    patches = _patches(weights, num_prefix_tokens, grid)  # (N, H, cells)
    return patches / patches.sum(-1, keepdim=True).clamp(min=1e-12)


def normalized_entropy(weights: torch.Tensor) -> torch.Tensor:
    """Entropy of each row over all image tokens divided by ``log(Lk)``: ``(N, H, Lk) -> (N, H)``, in [0, 1]."""
    _check_weights(weights)
    keys = weights.shape[-1]
    if keys < 2:
        return weights.new_zeros(weights.shape[:2])
    return -torch.special.xlogy(weights, weights).sum(-1) / math.log(keys)


def top_patch_mass(weights: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """The largest weight on one patch token (prefix tokens excluded): ``(N, H, Lk) -> (N, H)``."""
    return _patches(weights, num_prefix_tokens).amax(-1)


def prefix_mass(weights: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """The weight on the prefix tokens together: ``(N, H, Lk) -> (N, H)``."""
    _patches(weights, num_prefix_tokens)  # checks the shape
    return weights[..., :num_prefix_tokens].sum(-1)


def grid_positions(grid: tuple[int, int], device=None) -> torch.Tensor:
    """``(rows * cols, 2)`` (row, column) of each patch token, row-major like the ViT."""
    rows, cols = grid
    r, c = torch.meshgrid(torch.arange(rows, device=device), torch.arange(cols, device=device), indexing="ij")
    return torch.stack([r.reshape(-1), c.reshape(-1)], dim=-1).float()  # (cells, 2)


def attended_distance(weights: torch.Tensor, grid: tuple[int, int], num_prefix_tokens: int) -> torch.Tensor:
    """Expected grid distance (in cells) between an attended cell and the map's centroid: ``(N, H)``.

    The patch weights are renormalised over the grid first, so prefix tokens do not count; a row
    with no weight on the grid gets 0.
    """
    q = _patch_distribution(weights, num_prefix_tokens, grid)  # (N, H, cells)
    positions = grid_positions(grid, weights.device).to(weights.dtype)  # (cells, 2)
    centroid = q @ positions  # (N, H, 2)
    distances = torch.cdist(centroid.reshape(-1, 2), positions).view_as(q)  # (N * H, cells) -> (N, H, cells)
    return (q * distances).sum(-1)


def object_mass(weights: torch.Tensor, objects: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """Share of the (renormalised) patch weights on object cells: ``(N, H, Lk), (N, cells) -> (N, H)``."""
    q = _patch_distribution(weights, num_prefix_tokens)  # (N, H, cells)
    if objects.shape != (q.shape[0], q.shape[-1]):
        raise ValueError(f"objects must be (queries, cells) = {(q.shape[0], q.shape[-1])}, got {tuple(objects.shape)}")
    return (q * objects[:, None, :].to(q.dtype)).sum(-1)


def object_pointing(weights: torch.Tensor, objects: torch.Tensor, num_prefix_tokens: int) -> torch.Tensor:
    """Whether each head's largest patch weight is on an object cell: ``(N, H, Lk), (N, cells) -> (N, H)`` float 0/1."""
    patches = weights[..., num_prefix_tokens:]  # (N, H, cells)
    if objects.shape != (patches.shape[0], patches.shape[-1]):
        raise ValueError(f"objects must be (queries, cells) = {(patches.shape[0], patches.shape[-1])}, got {tuple(objects.shape)}")
    return objects.gather(1, patches.argmax(-1)).to(weights.dtype)  # (N, H)


def head_agreement(weights: torch.Tensor) -> torch.Tensor:
    """Bhattacharyya coefficient of every pair of heads, per row: ``(N, H, Lk) -> (N, H, H)``, in [0, 1]."""
    _check_weights(weights)
    root = weights.clamp(min=0).sqrt()  # (N, H, Lk)
    return root @ root.transpose(1, 2)  # (N, H, H)


def head_output_norms(head_inputs: torch.Tensor, out_weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Norm of each head's share of the attention output: ``(..., H * hd) -> (..., H)``.

    Args:
        head_inputs: the input of the attention's ``out_proj``, the heads' attention-weighted
            values side by side (head-major, as ``CrossAttention`` lays them out).
        out_weight: ``out_proj.weight``, ``(dim, H * hd)``.
        num_heads: ``H``.
    """
    inner = head_inputs.shape[-1]
    if inner % num_heads or out_weight.shape[-1] != inner:
        raise ValueError(
            f"head_inputs width {inner} and out_weight {tuple(out_weight.shape)} do not split into {num_heads} heads"
        )
    head_dim = inner // num_heads
    values = head_inputs.reshape(*head_inputs.shape[:-1], num_heads, head_dim)  # (..., H, hd)
    columns = out_weight.reshape(out_weight.shape[0], num_heads, head_dim)  # (dim, H, hd)
    return torch.einsum("...hd,ohd->...ho", values, columns.to(values.dtype)).norm(dim=-1)  # (..., H)


def object_cells(
    pixels: torch.Tensor, grid: tuple[int, int], *, tolerance: float = 0.15, min_share: float = 0.25
) -> torch.Tensor:
    """Which grid cells of each image hold an object: ``(B, 3, S, S) -> (B, rows * cols)`` bool.

    For images of objects on a plain background (easy-VQA, SHAPES): the background colour is the
    per-channel median of the border pixels; a pixel is foreground when a channel differs from it
    by more than ``tolerance`` (pixels in [0, 1]); a cell holds an object when at least
    ``min_share`` of its pixels are foreground (the image is average-pooled onto the grid).
    """
    if pixels.dim() != 4 or pixels.shape[1] != 3:
        raise ValueError(f"pixels must be (images, 3, height, width), got shape {tuple(pixels.shape)}")
    border = torch.cat(
        [pixels[..., 0, :], pixels[..., -1, :], pixels[..., 1:-1, 0], pixels[..., 1:-1, -1]], dim=-1
    )  # (B, 3, border pixels)
    background = border.median(dim=-1).values  # (B, 3)
    foreground = (pixels - background[..., None, None]).abs().amax(1, keepdim=True) > tolerance  # (B, 1, S, S)
    share = F.adaptive_avg_pool2d(foreground.float(), grid)  # (B, 1, rows, cols)
    return (share >= min_share).flatten(1)  # (B, rows * cols)


@dataclass
class HeadStats:
    """Per-head statistics of one layer, each ``(H,)``, averaged over ``num_queries`` query rows.

    Attributes:
        entropy, top_patch_mass, prefix_mass, distance, object_mass, agreement: see the module.
        object_lift: object mass / object area (NaN without object masks).
        pointing: share of query rows whose largest patch weight is on an object cell (NaN without object masks).
        contribution: output norm / the mean over heads (NaN without output norms).
        modal_key: the image token that is most often a head's top token.
        modal_share: share of query rows whose top token is ``modal_key``.
        modal_mass: mean weight on ``modal_key``.
        agreement_matrix: ``(H, H)`` mean pairwise agreement.
        mean_map: ``(H, Lk)`` mean attention over all rows.
        num_queries: query rows seen.
    """

    entropy: torch.Tensor
    top_patch_mass: torch.Tensor
    prefix_mass: torch.Tensor
    distance: torch.Tensor
    object_mass: torch.Tensor
    object_lift: torch.Tensor
    pointing: torch.Tensor
    agreement: torch.Tensor
    contribution: torch.Tensor
    modal_key: torch.Tensor
    modal_share: torch.Tensor
    modal_mass: torch.Tensor
    agreement_matrix: torch.Tensor
    mean_map: torch.Tensor
    num_queries: int

    @property
    def num_heads(self) -> int:
        return len(self.entropy)


class HeadStatsAccumulator:
    """Running sums of the statistics of one layer's heads; :meth:`result` gives the means.

    Args:
        num_heads: heads of the layer (``H``).
        grid: ``(rows, cols)`` of the patch grid.
        num_prefix_tokens: image tokens before the patch tokens.
    """

    _ROW_STATS = ("entropy", "top_patch_mass", "prefix_mass", "distance", "object_mass", "pointing", "output_norm")

    def __init__(self, num_heads: int, grid: tuple[int, int], num_prefix_tokens: int) -> None:
        self.num_heads, self.grid, self.num_prefix_tokens = num_heads, tuple(grid), num_prefix_tokens
        num_keys = num_prefix_tokens + grid[0] * grid[1]
        self.sums = {name: torch.zeros(num_heads, dtype=torch.float64) for name in self._ROW_STATS}
        self.object_area = 0.0
        self.rows = {"all": 0, "objects": 0, "outputs": 0}
        self.agreement = torch.zeros(num_heads, num_heads, dtype=torch.float64)
        self.map_sum = torch.zeros(num_heads, num_keys, dtype=torch.float64)
        self.top_counts = torch.zeros(num_heads, num_keys, dtype=torch.float64)

    def update(
        self, weights: torch.Tensor, objects: torch.Tensor | None = None, output_norms: torch.Tensor | None = None
    ) -> None:
        """Add query rows.

        Args:
            weights: ``(N, H, Lk)`` attention of N query rows.
            objects: ``(N, cells)`` bool, the object cells of each row's image (see :func:`object_cells`).
            output_norms: ``(N, H)`` from :func:`head_output_norms`.
        """
        _check_weights(weights)
        expected = (self.num_heads, self.map_sum.shape[1])
        if tuple(weights.shape[1:]) != expected:
            raise ValueError(f"weights must be (queries, {expected[0]}, {expected[1]}), got {tuple(weights.shape)}")
        w = weights.detach().float()
        n, prefix = len(w), self.num_prefix_tokens
        self._add("entropy", normalized_entropy(w))
        self._add("top_patch_mass", top_patch_mass(w, prefix))
        self._add("prefix_mass", prefix_mass(w, prefix))
        self._add("distance", attended_distance(w, self.grid, prefix))
        self.agreement += head_agreement(w).sum(0).cpu()
        self.map_sum += w.sum(0).cpu()
        top = F.one_hot(w.argmax(-1), w.shape[-1])  # (N, H, Lk)
        self.top_counts += top.sum(0).double().cpu()
        self.rows["all"] += n
        if objects is not None:
            self._add("object_mass", object_mass(w, objects, prefix))
            self._add("pointing", object_pointing(w, objects, prefix))
            self.object_area += float(objects.double().mean(-1).sum())
            self.rows["objects"] += n
        if output_norms is not None:
            self._add("output_norm", output_norms.detach().double())
            self.rows["outputs"] += n

    def _add(self, name: str, values: torch.Tensor) -> None:
        self.sums[name] += values.sum(0).cpu()  # (H,)

    def result(self) -> HeadStats:
        """The per-head means; raises if no row was added."""
        n = self.rows["all"]
        if n == 0:
            raise ValueError("no query rows were added: the data gave no questions")
        nan = torch.full((self.num_heads,), float("nan"), dtype=torch.float64)
        mean = {name: self.sums[name] / n for name in ("entropy", "top_patch_mass", "prefix_mass", "distance")}
        objects, outputs = self.rows["objects"], self.rows["outputs"]
        obj_mass = self.sums["object_mass"] / objects if objects else nan
        pointing = self.sums["pointing"] / objects if objects else nan
        area = self.object_area / objects if objects else float("nan")
        lift = obj_mass / area if area > 0 else nan
        norms = self.sums["output_norm"] / outputs if outputs else nan
        contribution = norms / norms.mean().clamp(min=1e-12) if outputs else nan
        agreement = self.agreement / n  # (H, H)
        others = max(self.num_heads - 1, 1)
        mean_map = self.map_sum / n  # (H, Lk)
        modal_key = self.top_counts.argmax(-1)  # (H,)
        rows = torch.arange(self.num_heads)
        return HeadStats(
            entropy=mean["entropy"].float(),
            top_patch_mass=mean["top_patch_mass"].float(),
            prefix_mass=mean["prefix_mass"].float(),
            distance=mean["distance"].float(),
            object_mass=obj_mass.float(),
            object_lift=lift.float(),
            pointing=pointing.float(),
            agreement=((agreement.sum(1) - agreement.diagonal()) / others).float(),
            contribution=contribution.float(),
            modal_key=modal_key,
            modal_share=(self.top_counts[rows, modal_key] / n).float(),
            modal_mass=mean_map[rows, modal_key].float(),
            agreement_matrix=agreement.float(),
            mean_map=mean_map.float(),
            num_queries=n,
        )
