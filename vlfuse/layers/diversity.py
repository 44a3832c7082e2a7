"""Head diversity: how alike the heads of one attention layer attend, as a differentiable penalty."""

from __future__ import annotations

import torch


def head_diversity(weights: torch.Tensor, query_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Mean pairwise cosine similarity between the heads' attention distributions, per query.

    For each query row, head h's weights over the keys form a vector ``w_h``; the similarity of
    heads h and g is ``<w_h, w_g> / (|w_h| |w_g|)``. It is averaged over the ``H (H - 1) / 2`` pairs
    of heads, then over the query rows. Attention weights are non-negative, so the result lies in
    [0, 1]: 0 when the heads attend disjoint sets of keys (orthogonal), 1 when they all attend
    alike. Adding it to the loss (times a weight) pushes the heads of a layer apart.

    Args:
        weights: ``(B, H, Lq, Lk)`` attention weights (e.g. from ``need_weights=True``).
        query_mask: ``(B, Lq)`` bool, True for real query rows; padding rows are left out, and so
            are rows in which some head has all-zero weights (a query with no key to attend).

    Returns:
        A scalar tensor; 0 with a single head (no pair) or when no row counts.
    """
    if weights.dim() != 4:
        raise ValueError(f"weights must be (batch, heads, queries, keys), got shape {tuple(weights.shape)}")
    b, heads, lq, _ = weights.shape
    if query_mask is not None and (query_mask.dtype != torch.bool or query_mask.shape != (b, lq)):
        raise ValueError(
            f"query_mask must be a bool tensor of shape {(b, lq)}, got {query_mask.dtype} {tuple(query_mask.shape)}"
        )
    if heads < 2:
        return weights.new_zeros(())
    norms = torch.linalg.vector_norm(weights, dim=-1)  # (B, H, Lq)
    unit = (weights / norms.clamp_min(torch.finfo(weights.dtype).eps)[..., None]).transpose(1, 2)  # (B, Lq, H, Lk)
    cosines = unit @ unit.transpose(-2, -1)  # (B, Lq, H, H)
    first, second = torch.triu_indices(heads, heads, offset=1, device=weights.device)
    mean_pair = cosines[..., first, second].mean(dim=-1)  # (B, Lq), over the H (H - 1) / 2 pairs
    rows = (norms > 0).all(dim=1)  # (B, Lq)
    if query_mask is not None:
        rows = rows & query_mask
    rows = rows.to(weights.dtype)
    return (mean_pair * rows).sum() / rows.sum().clamp_min(1.0)
