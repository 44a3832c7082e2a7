"""How much each fusion cross-attention head matters: three scores, and accuracy as heads go.

Every score is an ``(L, H0)`` tensor over the *original* head ids of the L fusion layers (H0
heads each when built), higher meaning more important, NaN for heads already pruned:

- :func:`weight_norm_scores`: the Frobenius norm of the head's query-projection rows;
- :func:`gradient_scores`: Michel et al. (2019), the expected ``|dLoss/dg|`` of a gate ``g`` on
  the head's output;
- :func:`ablation_scores`: the accuracy lost when that head alone is removed.

:func:`score_heads` picks one by name (:data:`HEAD_SCORES`). Heads are switched off through the
model's ``head_mask`` (see :meth:`vlfuse.model.VLFuseModel.fuse`), which multiplies each head's
output before the output projection: 0 gives the same logits as removing the head for real
(``prune_heads``), so every head setting reuses one encoding of the images and questions.

``batches`` are :func:`vlfuse.data.collate_grouped` batches (``pixel_values``, ``questions``,
``labels`` with ``IGNORE_INDEX`` for answers outside the vocabulary, ``image_index``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from vlfuse.analysis.pruning import heads_to_prune
from vlfuse.data import IGNORE_INDEX
from vlfuse.model import ImageContext, VLFuseModel


def original_head_count(model: VLFuseModel) -> int:
    """H0: the heads each fusion layer was built with (before any pruning)."""
    return model.num_heads_built


def present_heads(model: VLFuseModel) -> torch.Tensor:
    """``(L, H0)`` bool, True for the heads still in the model."""
    present = torch.zeros(model.num_fusion_layers, original_head_count(model), dtype=torch.bool)
    for layer, ids in enumerate(model.fusion_head_ids):
        present[layer, ids] = True
    return present


def full_head_mask(model: VLFuseModel, rows: int | None = None) -> torch.Tensor:
    """A ``head_mask`` that keeps every head: ``(L, H0)``, or ``(rows, L, H0)`` for one row per question.

    Ones for the heads present, NaN (ignored by the model) for heads already pruned; in the model's
    dtype and on its device. Set entries to 0 to switch heads off, or ``requires_grad_()`` it to
    differentiate through the heads' outputs.
    """
    parameter = next(model.parameters())
    present = present_heads(model).to(parameter.device)
    mask = torch.ones(present.shape, device=parameter.device, dtype=parameter.dtype).masked_fill(~present, float("nan"))
    return mask if rows is None else mask.expand(rows, *mask.shape).clone()


# ------------------------------------------------------------------------- encoded batches
@dataclass
class _Encoded:
    """A batch with its images and questions encoded once, reused for every head setting (the
    head mask acts after both, on the cross-attention outputs)."""

    image_context: ImageContext
    text: torch.Tensor
    text_mask: torch.Tensor
    image_index: torch.Tensor
    labels: torch.Tensor


def _encode(model: VLFuseModel, batches: Sequence[dict]) -> list[_Encoded]:
    parameter = next(model.parameters())
    device = parameter.device
    encoded = []
    with torch.no_grad():
        for batch in batches:
            inputs = model.processor.batch(batch, device, parameter.dtype)
            encoded.append(
                _Encoded(
                    model.encode_images(inputs.pixel_values, inputs.image_keys),
                    model.encode_questions(inputs.input_ids, inputs.attention_mask),
                    inputs.attention_mask.bool(),
                    inputs.image_index,
                    batch["labels"].to(device),
                )
            )
    return encoded


def _logits(model: VLFuseModel, batch: _Encoded, head_mask: torch.Tensor | None = None) -> torch.Tensor:
    """The model's last two stages, :meth:`~VLFuseModel.fuse` and :meth:`~VLFuseModel.read_out`, on an encoded batch."""
    fused = model.fuse(batch.text, batch.text_mask, batch.image_context, batch.image_index, head_mask=head_mask)
    return model.read_out(fused.output, batch.text_mask)


def _accuracy(model: VLFuseModel, encoded: Sequence[_Encoded], head_mask: torch.Tensor | None = None) -> float:
    correct = total = 0
    with torch.no_grad():
        for batch in encoded:
            valid = batch.labels != IGNORE_INDEX
            correct += int((_logits(model, batch, head_mask).argmax(-1)[valid] == batch.labels[valid]).sum())
            total += int(valid.sum())
    if total == 0:
        raise ValueError("the batches hold no question with an answer in the model's vocabulary")
    return correct / total


@contextmanager
def _eval_mode(model: VLFuseModel) -> Iterator[None]:
    training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(training)


# ------------------------------------------------------------------------------------ scores
def evaluate(model: VLFuseModel, batches: Sequence[dict]) -> float:
    """Accuracy over every question whose label is not ``IGNORE_INDEX`` (eval mode)."""
    with _eval_mode(model):
        return _accuracy(model, _encode(model, batches))


def weight_norm_scores(model: VLFuseModel, average_layers: bool = False) -> torch.Tensor:
    """``||W_i^Q[l]||_F``: the Frobenius norm of each head's rows of the query projection.

    Args:
        average_layers: the literal score of the design literature, ``s_i = (1/L) sum_l
            ||W_i^Q[l]||_F``: the mean over layers for head index i (over the layers where it is
            present), repeated in every layer. Head i of one layer and head i of another are
            unrelated (nothing ties their indices together), so this is reported for comparison
            only; pruning uses the per-layer norms (the default).

    Returns:
        ``(L, H0)``, NaN for heads already pruned.
    """
    scores = torch.full(present_heads(model).shape, float("nan"))
    with torch.no_grad():
        for layer, attn in enumerate(model.attention_layers):
            rows = attn.q_proj.weight.view(attn.num_heads, attn.head_dim, attn.dim)  # (H, hd, dim)
            scores[layer, attn.head_ids] = rows.pow(2).sum((1, 2)).sqrt().float().cpu()
    if average_layers:
        scores = torch.where(torch.isnan(scores), scores, scores.nanmean(0, keepdim=True))
    return scores


def gradient_scores(model: VLFuseModel, batches: Sequence[dict], normalize: bool = True) -> torch.Tensor:
    """Michel et al. (2019): ``I_h = E_x |dL(x)/dg_h|`` for a gate ``g_h = 1`` on each head's output.

    ``L(x)`` is the cross-entropy of one question with its gold answer, and the mean runs over
    questions (their definition), not over batches as in their code: every question gets its own
    gates, so one backward pass per batch gives each question's gradient. Questions labelled
    ``IGNORE_INDEX`` are left out. Eval mode (no dropout).

    Args:
        normalize: divide each layer's scores by their L2 norm, as Michel et al. do before ranking
            heads across layers.

    Returns:
        ``(L, H0)``, NaN for heads already pruned.
    """
    present = present_heads(model)
    total, count = torch.zeros(present.shape, dtype=torch.float64), 0
    with _eval_mode(model):
        for batch in _encode(model, batches):
            gates = full_head_mask(model, rows=len(batch.labels)).requires_grad_(True)
            logits = _logits(model, batch, head_mask=gates)
            loss = F.cross_entropy(logits, batch.labels, ignore_index=IGNORE_INDEX, reduction="sum")
            (grad,) = torch.autograd.grad(loss, gates)  # (Bq, L, H0): row x holds dL(x)/dg, 0 for pruned heads
            total += grad.abs().sum(0).double().cpu()
            count += int((batch.labels != IGNORE_INDEX).sum())
    if count == 0:
        raise ValueError("the batches hold no question with an answer in the model's vocabulary")
    scores = (total / count).masked_fill(~present, float("nan"))
    if normalize:
        scores = scores / scores.nan_to_num(0.0).norm(dim=1, keepdim=True).clamp(min=1e-20)
    return scores.float()


def ablation_scores(model: VLFuseModel, batches: Sequence[dict]) -> torch.Tensor:
    """The accuracy drop when one head alone is removed: ``acc(all heads) - acc(without head)``.

    Returns:
        ``(L, H0)`` in accuracy units (0.01 = one point), NaN for heads already pruned.
    """
    present = present_heads(model)
    scores = torch.full(present.shape, float("nan"))
    with _eval_mode(model):
        encoded = _encode(model, batches)
        base = _accuracy(model, encoded)
        for layer, head in present.nonzero().tolist():
            gates = full_head_mask(model)
            gates[layer, head] = 0.0
            scores[layer, head] = base - _accuracy(model, encoded, gates)
    return scores


def pruning_curve(
    model: VLFuseModel, scores: torch.Tensor, batches: Sequence[dict], fractions: Sequence[float]
) -> list[tuple[float, float]]:
    """Accuracy with the lowest-scored heads removed: ``[(fraction, accuracy)]``.

    The heads of each fraction are chosen by :func:`vlfuse.analysis.pruning.heads_to_prune`:
    ranked globally over all layers (a layer that matters more keeps more heads), each layer
    keeping at least one head; fractions count the heads still present. Heads are switched off
    by the head mask (equal to pruning them), so the images and questions are encoded once.
    """
    results = []
    with _eval_mode(model):
        encoded = _encode(model, batches)
        for fraction in fractions:
            gates = full_head_mask(model)
            for layer, heads in heads_to_prune(scores, fraction=fraction).items():
                gates[layer, heads] = 0.0
            results.append((fraction, _accuracy(model, encoded, gates)))
    return results


HEAD_SCORES: dict[str, Callable[[VLFuseModel, Sequence[dict]], torch.Tensor]] = {
    "weight_norm": lambda model, batches: weight_norm_scores(model),
    "weight_norm_mean": lambda model, batches: weight_norm_scores(model, average_layers=True),
    "gradient": gradient_scores,
    "ablation": ablation_scores,
}
"""The head scores by name: ``(model, batches) -> (L, H0)`` (weight norms ignore the batches)."""


def score_heads(model: VLFuseModel, name: str, batches: Sequence[dict]) -> torch.Tensor:
    """The ``(L, H0)`` scores named ``name`` (a key of :data:`HEAD_SCORES`)."""
    if name not in HEAD_SCORES:
        raise ValueError(f"unknown head score {name!r}; expected one of {sorted(HEAD_SCORES)}")
    return HEAD_SCORES[name](model, batches)
