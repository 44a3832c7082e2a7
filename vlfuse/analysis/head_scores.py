"""How much each fusion cross-attention head matters: three scores, and accuracy as heads go.

Every score is an ``(L, H0)`` tensor over the *original* head ids of the L fusion layers (H0
heads each when built), higher meaning more important, NaN for heads already pruned:

- :func:`weight_norm_scores`: the Frobenius norm of the head's query-projection rows;
- :func:`gradient_scores`: Michel et al. (2019), the expected ``|dLoss/dg|`` of a gate ``g`` on
  the head's output;
- :func:`ablation_scores`: the accuracy lost when that head alone is removed.

Heads are switched off with :func:`head_gates`, which multiplies each head's output by a gate
before the output projection: gate 0 gives the same logits as removing the head for real
(``prune_heads``), so every head setting reuses one encoding of the images and questions.

``batches`` are :func:`vlfuse.data.collate_grouped` batches (``pixel_values``, ``questions``,
``labels`` with ``IGNORE_INDEX`` for answers outside the vocabulary, ``image_index``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from vlfuse.analysis.pruning import heads_to_prune
from vlfuse.data import IGNORE_INDEX
from vlfuse.layers import CrossAttention, ProjectedContext
from vlfuse.model import VLFuseModel


def _cross_attentions(model: VLFuseModel) -> list[CrossAttention]:
    return [block.cross_attn for block in model.fusion.blocks]


def original_head_count(model: VLFuseModel) -> int:
    """H0: the heads each fusion layer was built with (before any pruning)."""
    counts = {attn.dim // attn.head_dim for attn in _cross_attentions(model)}
    if len(counts) != 1:
        raise ValueError(f"fusion layers were built with different head counts {sorted(counts)}")
    return counts.pop()


def present_heads(model: VLFuseModel) -> torch.Tensor:
    """``(L, H0)`` bool, True for the heads still in the model."""
    present = torch.zeros(len(model.fusion), original_head_count(model), dtype=torch.bool)
    for layer, attn in enumerate(_cross_attentions(model)):
        present[layer, attn.head_ids] = True
    return present


# ----------------------------------------------------------------------------------- gates
@contextmanager
def head_gates(model: VLFuseModel, rows: int | None = None) -> Iterator[torch.Tensor]:
    """Multiply each cross-attention head's output by a gate, while the context is open.

    A forward pre-hook on every fusion layer's ``cross_attn.out_proj`` scales the slice of its
    input (head-major, ``(..., H * hd)`` over the heads present) that belongs to each head.

    Args:
        model: the model; its heads may already be pruned. Prune nothing while the context is
            open: the hooks sit on the output projections present when it opened.
        rows: ``None`` for one gate per head, ``(L, H0)``; or N for one gate row per question,
            ``(N, L, H0)``, when every forward pass has N questions (per-example gradients).

    Yields:
        The gates, ones in the model's dtype and on its device, indexed by original head id;
        entries of heads already pruned are 0 and unused. Change them in place, or call
        ``requires_grad_()`` to differentiate through them.
    """
    parameter = next(model.parameters())
    present = present_heads(model)
    shape = present.shape if rows is None else (rows, *present.shape)
    gates = torch.zeros(shape, device=parameter.device, dtype=parameter.dtype)
    gates[..., present.to(parameter.device)] = 1.0
    handles = [
        attn.out_proj.register_forward_pre_hook(_gate_hook(gates, layer, attn.head_ids, attn.head_dim))
        for layer, attn in enumerate(_cross_attentions(model))
    ]
    try:
        yield gates
    finally:
        for handle in handles:
            handle.remove()


def _gate_hook(gates: torch.Tensor, layer: int, head_ids: list[int], head_dim: int):
    ids = torch.tensor(head_ids, device=gates.device)

    def hook(module, args):
        (x,) = args
        gate = gates[..., layer, ids]  # (H,) or (N, H)
        if gate.dim() == 2:
            if gate.shape[0] != x.shape[0]:
                raise ValueError(f"head_gates(rows={gate.shape[0]}) got a forward pass of {x.shape[0]} questions")
            gate = gate.view(gate.shape[0], *[1] * (x.dim() - 2), gate.shape[1])  # (N, 1.., H)
        heads = x.unflatten(-1, (len(head_ids), head_dim))  # (..., H, hd)
        return ((heads * gate.unsqueeze(-1)).flatten(-2),)  # (..., H * hd)

    return hook


# ------------------------------------------------------------------------- encoded batches
@dataclass
class _Encoded:
    """A batch with its image keys/values and question states computed once, reused for every
    head setting (gates act after both, on the cross-attention outputs)."""

    image_kvs: list[ProjectedContext]
    question_states: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    image_index: torch.Tensor
    labels: torch.Tensor


def _encode(model: VLFuseModel, batches: Sequence[dict]) -> list[_Encoded]:
    parameter = next(model.parameters())
    device = parameter.device
    encoded = []
    with torch.no_grad():
        for batch in batches:
            tokens = {k: v.to(device) for k, v in model.tokenize(batch["questions"]).items()}
            encoded.append(
                _Encoded(
                    model.encode_images(batch["pixel_values"].to(device, parameter.dtype)),
                    model.encode_questions(tokens["input_ids"], tokens["attention_mask"]),
                    tokens["input_ids"],
                    tokens["attention_mask"],
                    batch["image_index"].to(device),
                    batch["labels"].to(device),
                )
            )
    return encoded


def _logits(model: VLFuseModel, batch: _Encoded) -> torch.Tensor:
    """``model``'s own forward pass, given the batch's image keys/values and question states."""
    # The forward pass takes image keys/values but always encodes the questions (a quarter of an
    # evaluation's time on easy-VQA): its encode_questions is shadowed by the stored states.
    model.encode_questions = lambda input_ids, attention_mask: batch.question_states
    try:
        return model(
            None, batch.input_ids, batch.attention_mask, image_index=batch.image_index, image_kvs=batch.image_kvs
        ).logits
    finally:
        del model.encode_questions


def _accuracy(model: VLFuseModel, encoded: Sequence[_Encoded]) -> float:
    correct = total = 0
    with torch.no_grad():
        for batch in encoded:
            valid = batch.labels != IGNORE_INDEX
            correct += int((_logits(model, batch).argmax(-1)[valid] == batch.labels[valid]).sum())
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
        for layer, attn in enumerate(_cross_attentions(model)):
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
            with head_gates(model, rows=len(batch.labels)) as gates:
                gates.requires_grad_(True)
                loss = F.cross_entropy(_logits(model, batch), batch.labels, ignore_index=IGNORE_INDEX, reduction="sum")
                (grad,) = torch.autograd.grad(loss, gates)  # (Bq, L, H0): row x holds dL(x)/dg
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
        with head_gates(model) as gates:
            base = _accuracy(model, encoded)
            for layer, head in present.nonzero().tolist():
                gates[layer, head] = 0.0
                scores[layer, head] = base - _accuracy(model, encoded)
                gates[layer, head] = 1.0
    return scores


def pruning_curve(
    model: VLFuseModel, scores: torch.Tensor, batches: Sequence[dict], fractions: Sequence[float]
) -> list[tuple[float, float]]:
    """Accuracy with the lowest-scored heads removed: ``[(fraction, accuracy)]``.

    The heads of each fraction are chosen by :func:`vlfuse.analysis.pruning.heads_to_prune`:
    ranked globally over all layers (a layer that matters more keeps more heads), each layer
    keeping at least one head; fractions count the heads still present. Heads are switched off
    by gates (equal to pruning them), so the images and questions are encoded once.
    """
    results = []
    with _eval_mode(model):
        encoded = _encode(model, batches)
        with head_gates(model) as gates:
            ones = gates.clone()
            for fraction in fractions:
                gates.copy_(ones)
                for layer, heads in heads_to_prune(scores, fraction=fraction).items():
                    gates[layer, heads] = 0.0
                results.append((fraction, _accuracy(model, encoded)))
    return results
