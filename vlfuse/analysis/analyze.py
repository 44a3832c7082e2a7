"""What each attention head does and which heads matter, as a markdown report (``vlfuse analyze``)."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from vlfuse.analysis.collect import collect_head_stats
from vlfuse.analysis.head_scores import evaluate, original_head_count, pruning_curve, score_heads
from vlfuse.analysis.report import write_report
from vlfuse.model import VLFuseModel

DEFAULT_FRACTIONS = tuple(round(0.1 * i, 1) for i in range(10))
REPORTED_SCORES = {"weight norm": "weight_norm", "weight norm s_i": "weight_norm_mean", "gradient": "gradient", "ablation": "ablation"}
"""The scores in the report: ``{title: name in HEAD_SCORES}``."""
SCORE_NOTES = {
    "weight norm": "||W_i^Q[l]||_F, the Frobenius norm of head i's rows of the query projection of its own "
    "layer l (head i of one layer and head i of another are unrelated heads).",
    "weight norm s_i": "s_i = (1/L) sum_l ||W_i^Q[l]||_F, the mean over the layers for head index i: the same "
    "value for head i in every layer.",
    "gradient": "Michel et al. (2019): the mean over questions of |dLoss/dg_i| for a gate g_i = 1 on the head's "
    "output (cross-entropy with the gold answer), each layer's scores divided by their L2 norm.",
    "ablation": "the accuracy lost when this head alone is removed (0.01 = one point; negative when the "
    "accuracy rises).",
}


def analyze(
    model: VLFuseModel,
    batches: list[dict],
    out_dir: str | Path,
    *,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    context: dict[str, str] | None = None,
) -> Path:
    """Collect head statistics, score the heads, draw the pruning curves and write the report.

    Returns:
        The path of ``report.md``.
    """
    collection = collect_head_stats(model, batches)
    scores = {title: score_heads(model, name, batches) for title, name in REPORTED_SCORES.items()}
    curves = {name: pruning_curve(model, score, batches, fractions) for name, score in scores.items()}
    return write_report(
        out_dir,
        collection,
        num_heads=original_head_count(model),
        scores=scores,
        curves=curves,
        accuracy=evaluate(model, batches),
        context=context or {},
        score_notes=SCORE_NOTES,
    )
