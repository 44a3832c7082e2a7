"""The head-analysis report: ``report.md`` with its PNG figures beside it.

Tables per layer (one row per head), the rules and thresholds written out, example maps per role
tag, the three head-importance scores side by side with their Spearman rank correlations, and
accuracy against the fraction of heads pruned.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np
import torch

from vlfuse.analysis.attention_maps import draw_attention_map
from vlfuse.analysis.collect import HeadCollection
from vlfuse.analysis.figures import draw_agreement, draw_layer_head_maps, draw_pruning_curves
from vlfuse.analysis.head_roles import ROLES, HeadRules, dead_heads, role_tags
from vlfuse.analysis.tables import markdown_table

STATISTICS = {
    # column title -> (HeadStats attribute, format)
    "entropy": ("entropy", "{:.3f}"),
    "top patch": ("top_patch_mass", "{:.3f}"),
    "prefix": ("prefix_mass", "{:.3f}"),
    "distance": ("distance", "{:.2f}"),
    "object mass": ("object_mass", "{:.3f}"),
    "object lift": ("object_lift", "{:.2f}"),
    "pointing": ("pointing", "{:.3f}"),
    "agreement": ("agreement", "{:.3f}"),
    "contribution": ("contribution", "{:.2f}"),
}
HEADS_PER_ROLE_FIGURE = 6
"""Heads drawn in one role-example figure (the first of the tag, layer by layer)."""


def rank(values: torch.Tensor) -> torch.Tensor:
    """Ranks from 1 (smallest) with ties given their mean rank: ``(n,) -> (n,)`` float."""
    order = values.argsort()
    positions = torch.empty(len(values), dtype=torch.float64)
    positions[order] = torch.arange(1, len(values) + 1, dtype=torch.float64)
    _, groups = torch.unique(values, return_inverse=True)
    totals = torch.zeros(int(groups.max()) + 1 if len(values) else 0, dtype=torch.float64)
    counts = torch.zeros_like(totals)
    totals.index_add_(0, groups, positions)
    counts.index_add_(0, groups, torch.ones_like(positions))
    return (totals / counts)[groups]


def spearman(a: torch.Tensor, b: torch.Tensor) -> float:
    """Spearman rank correlation of two score tensors of one shape, over entries finite in both.

    NaN when fewer than two such entries remain or either side is constant.
    """
    if a.shape != b.shape:
        raise ValueError(f"scores to correlate must have one shape, got {tuple(a.shape)} and {tuple(b.shape)}")
    a, b = a.flatten().double(), b.flatten().double()
    keep = a.isfinite() & b.isfinite()
    if int(keep.sum()) < 2:
        return float("nan")
    ra, rb = rank(a[keep]), rank(b[keep])
    ra, rb = ra - ra.mean(), rb - rb.mean()
    denominator = float(ra.norm() * rb.norm())
    return float((ra * rb).sum()) / denominator if denominator > 0 else float("nan")


def by_original_head(collection: HeadCollection, attribute: str, num_heads: int) -> np.ndarray:
    """``(layers, num_heads)`` values of one statistic over original head ids, NaN for pruned heads."""
    table = np.full((len(collection.stats), num_heads), np.nan)
    for layer, (stats, ids) in enumerate(zip(collection.stats, collection.head_ids)):
        table[layer, ids] = getattr(stats, attribute).numpy()
    return table


def write_report(
    out_dir: str | Path,
    collection: HeadCollection,
    *,
    num_heads: int,
    scores: Mapping[str, torch.Tensor],
    curves: Mapping[str, Sequence[tuple[float, float]]],
    accuracy: float,
    context: Mapping[str, str],
    score_notes: Mapping[str, str] | None = None,
    rules: HeadRules = HeadRules(),
) -> Path:
    """Write ``report.md`` and its PNG figures to ``out_dir``; return the path of ``report.md``.

    Args:
        out_dir: the folder (created if missing).
        collection: the head statistics from :func:`vlfuse.analysis.collect.collect_head_stats`.
        num_heads: heads each fusion layer was built with (original head ids run over ``range(num_heads)``).
        scores: ``name -> (layers, num_heads)`` importance scores (higher = more important),
            NaN for pruned heads.
        curves: ``name -> [(fraction pruned, accuracy)]``, one per score.
        accuracy: the model's accuracy on the analysed batches, before any pruning.
        context: ``label -> value`` lines for the report's header (model, config, split).
        score_notes: ``name -> definition`` of each score, written above the scores table.
        rules: the thresholds of the dead-head flag, role tags and object cells.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    grid = collection.grid
    dead = [dead_heads(stats, rules) for stats in collection.stats]
    roles = [role_tags(stats, grid, rules) for stats in collection.stats]
    lines = _header(collection, accuracy, context, dead, roles)
    lines += _definitions(collection, rules)
    lines += _statistics_section(out, collection, num_heads, dead, roles)
    lines += _roles_section(out, collection, roles)
    lines += _scores_section(out, collection, scores, score_notes or {})
    lines += _pruning_section(out, curves, collection)
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def _header(collection, accuracy, context, dead, roles) -> list[str]:
    counts = Counter(tag for layer in roles for tag in layer)
    dead_list = [
        f"{layer}.{head}"
        for layer, flags in enumerate(dead)
        for head, flag in zip(collection.head_ids[layer], flags)
        if flag
    ]
    total = sum(len(ids) for ids in collection.head_ids)
    rows, cols = collection.grid
    lines = ["# Head analysis", ""]
    lines += [f"- {label}: {value}" for label, value in context.items()]
    lines += [
        f"- data: {collection.num_images} images, {collection.num_questions} questions, "
        f"{collection.stats[0].num_queries} query tokens (the real question tokens)",
        f"- image tokens: {collection.num_prefix_tokens} prefix + a {rows}x{cols} patch grid",
        f"- fusion layers: {len(collection.stats)}, heads: {total} (heads are named layer.head, by original id)",
        f"- accuracy: {accuracy:.4f}",
        "- roles: " + ", ".join(f"{tag} {counts[tag]}" for tag in ROLES),
        f"- dead heads: {len(dead_list)} of {total}" + (f" ({', '.join(dead_list)})" if dead_list else ""),
        "",
    ]
    return lines


def _definitions(collection: HeadCollection, rules: HeadRules) -> list[str]:
    return [
        "## Statistics, rules and thresholds",
        "",
        "Every statistic is the mean over all real question tokens (the queries, special tokens "
        "included) of the attention of one head over the image tokens.",
        "",
        "- **entropy**: normalised entropy, -sum p log p / log(number of image tokens): 1 = uniform, 0 = one token.",
        "- **top patch**: the largest weight on a single patch (prefix tokens excluded).",
        "- **prefix**: the weight on the prefix tokens (CLS, registers) together.",
        "- **distance**: the patch weights renormalised over the grid; the expected distance, in grid "
        "cells, between an attended cell and the map's centroid (0 = one cell; a uniform 3x3 "
        "neighbourhood gives 1.07).",
        "- **object mass**: the share of the renormalised patch weights on object cells; **object lift**: "
        "object mass / object area (1 = no preference for objects).",
        "- **pointing**: the share of query rows whose largest patch weight is on an object cell (the "
        "pointing game's hit rate for this head; the object-area share is what a random patch would score).",
        "- **agreement**: the Bhattacharyya coefficient sum sqrt(p q) between this head's distribution "
        "and each other head's of the layer, averaged (1 = identical, 0 = disjoint).",
        "- **contribution**: the norm of the head's share of the attention output (its attention-weighted "
        "values through its columns of the output projection), relative to the mean over the layer's heads.",
        "",
        *rules.describe(collection.grid),
        "",
    ]


def _statistics_section(out: Path, collection, num_heads: int, dead, roles) -> list[str]:
    panels = {title: by_original_head(collection, attr, num_heads) for title, (attr, _) in STATISTICS.items()}
    draw_layer_head_maps(panels, out / "head_statistics.png", title="statistics per head (blank: pruned)")
    draw_agreement(
        [s.agreement_matrix.numpy() for s in collection.stats], collection.head_ids, out / "head_agreement.png"
    )
    lines = ["## Statistics per head", "", "![statistics per head](head_statistics.png)", ""]
    lines += ["![agreement between heads](head_agreement.png)", ""]
    columns = ["head", *STATISTICS, "dead", "role"]
    formats = [None, *(pattern for _, pattern in STATISTICS.values()), None, None]
    for layer, (stats, ids) in enumerate(zip(collection.stats, collection.head_ids)):
        pruned = sorted(set(range(num_heads)) - set(ids))
        lines += [f"### Layer {layer}", ""]
        if pruned:
            lines += [f"Pruned heads: {', '.join(map(str, pruned))}.", ""]
        rows = [
            [head, *(float(getattr(stats, attr)[i]) for attr, _ in STATISTICS.values()),
             "yes" if dead[layer][i] else "", roles[layer][i]]
            for i, head in enumerate(ids)
        ]
        lines += [markdown_table(columns, rows, formats=formats, align="r" * (len(columns) - 2) + "ll"), ""]
    return lines


def _roles_section(out: Path, collection: HeadCollection, roles) -> list[str]:
    lines = ["## Example maps per role", ""]
    if not collection.examples:
        return lines + ["No example pairs were kept.", ""]
    lines += [
        "The attention of the pooled question (mean over its real tokens) of the first heads with "
        "each tag, on the first images of the split; colour: attention to each patch, one scale per "
        "figure; the panel titles give the weight on the prefix tokens.",
        "",
    ]
    for tag in ROLES:
        heads = [(layer, i) for layer, tags in enumerate(roles) for i, t in enumerate(tags) if t == tag]
        if not heads:
            lines += [f"- **{tag}**: no head.", ""]
            continue
        shown = heads[:HEADS_PER_ROLE_FIGURE]
        names = [f"{layer}.{collection.head_ids[layer][i]}" for layer, i in shown]
        more = "" if len(heads) == len(shown) else ", ..."
        lines += [f"### {tag} ({len(heads)} heads: {', '.join(names)}{more})", ""]
        for e, example in enumerate(collection.examples):
            weights = torch.stack([example.weights[layer][i] for layer, i in shown])  # (k, Lk)
            name = f"role_{tag}_{e}.png"
            image = example.pixels.permute(1, 2, 0).clamp(0, 1).numpy()  # (S, S, 3)
            draw_attention_map(
                image, weights, collection.grid, collection.num_prefix_tokens, out / name,
                head_ids=names, title=f"{tag} heads: {example.question!r}", columns=4,
            )
            lines.append(f"![{tag} heads, example {e}]({name})")
        lines.append("")
    return lines


def _scores_section(out: Path, collection: HeadCollection, scores, notes: Mapping[str, str]) -> list[str]:
    names = list(scores)
    lines = ["## Head importance", ""]
    lines += ["Higher = more important. Ranks run over all heads of the model (1 = most important).", ""]
    lines += [f"- **{name}**: {notes[name]}" for name in names if name in notes] + [""]
    if not names:
        return lines + ["No scores were computed.", ""]
    draw_layer_head_maps(
        {name: scores[name].numpy() for name in names}, out / "head_scores.png", title="importance scores per head"
    )
    lines += ["![importance scores per head](head_scores.png)", ""]
    ranks = {}
    for name in names:
        flat = scores[name].flatten().double()
        keep = flat.isfinite()
        ranked = torch.full_like(flat, float("nan"))
        ranked[keep] = int(keep.sum()) + 1 - rank(flat[keep])  # 1 = the highest score
        ranks[name] = ranked.view_as(scores[name])
    header = ["layer", "head", *names, *(f"rank ({n})" for n in names)]
    rows = [
        [layer, head, *(float(scores[n][layer, head]) for n in names), *(float(ranks[n][layer, head]) for n in names)]
        for layer, ids in enumerate(collection.head_ids)
        for head in ids
    ]
    lines += [markdown_table(header, rows, formats=[None, None, *["{:.4g}"] * len(names), *["{:.0f}"] * len(names)])]
    lines += ["", "Spearman rank correlation between the scores:", ""]
    correlations = [[a, *(spearman(scores[a], scores[b]) for b in names)] for a in names]
    lines += [markdown_table(["", *names], correlations, formats="{:.3f}"), ""]
    return lines


def _pruning_section(out: Path, curves: Mapping[str, Sequence[tuple[float, float]]], collection) -> list[str]:
    lines = ["## Accuracy against the fraction of heads pruned", ""]
    if not curves:
        return lines + ["No pruning curve was computed.", ""]
    draw_pruning_curves(curves, out / "pruning_curve.png")
    total = sum(len(ids) for ids in collection.head_ids)
    names = list(curves)
    fractions = sorted({f for points in curves.values() for f, _ in points})
    accuracy = {name: dict(points) for name, points in curves.items()}
    lines += [
        f"For each score, the lowest-scored heads are switched off, ranked over all {total} heads of the "
        "model, each layer keeping at least one (`vlfuse.analysis.pruning.heads_to_prune`).",
        "",
        "![accuracy against the fraction of heads pruned](pruning_curve.png)",
        "",
    ]
    rows = [[f, *(accuracy[n].get(f, float("nan")) for n in names)] for f in fractions]
    lines += [markdown_table(["fraction pruned", *names], rows, formats=["{:.2f}", *["{:.4f}"] * len(names)]), ""]
    return lines
