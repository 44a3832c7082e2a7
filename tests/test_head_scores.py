"""Head masks, the three head scores and the pruning curve, on a tiny untrained model."""

import math

import pytest
import torch
import torch.nn.functional as F

from vlfuse.analysis.head_scores import (
    ablation_scores,
    evaluate,
    full_head_mask,
    gradient_scores,
    pruning_curve,
    weight_norm_scores,
)
from vlfuse.analysis.pruning import heads_to_prune, prune_model
from vlfuse.data import IGNORE_INDEX
from vlfuse.model import VLFuseModel

from conftest import HEADS, SCORED_ANSWERS, SCORED_QUESTIONS, logits, make_batches, tiny_config

ANSWERS, QUESTIONS = SCORED_ANSWERS, SCORED_QUESTIONS

pytestmark = pytest.mark.usefixtures("one_thread")


# -------------------------------------------------------------------------------- head mask
def test_a_full_head_mask_leaves_the_logits_unchanged(model, batches):
    with torch.no_grad():
        expected = logits(model, batches[0])
        mask = full_head_mask(model)
        assert mask.shape == (2, 16) and bool((mask == 1).all())
        torch.testing.assert_close(logits(model, batches[0], head_mask=mask), expected, atol=0, rtol=0)
        rows = full_head_mask(model, rows=len(batches[0]["questions"]))
        assert rows.shape == (len(batches[0]["questions"]), 2, 16)
        torch.testing.assert_close(logits(model, batches[0], head_mask=rows), expected, atol=0, rtol=0)


@pytest.mark.parametrize("already_pruned", [{}, {0: [2], 1: [7, 8]}])
def test_gate_zero_gives_the_logits_of_physical_pruning(model, batches, already_pruned):
    base = prune_model(model, already_pruned) if already_pruned else model
    with torch.no_grad():
        expected = logits(prune_model(base, HEADS), batches[1])
        gates = full_head_mask(base)
        for layer, heads in already_pruned.items():
            assert bool(gates[layer, heads].isnan().all())  # removed heads are ignored
        for layer, heads in HEADS.items():
            gates[layer, heads] = 0.0
        gated = logits(base, batches[1], head_mask=gates)
        assert not torch.allclose(gated, logits(base, batches[1]))  # the gates did something
    torch.testing.assert_close(gated, expected, atol=1e-5, rtol=1e-5)


def test_per_question_gates_refuse_another_batch_size(model, batches):
    with torch.no_grad(), pytest.raises(ValueError, match=r"head_mask must have shape \(16,\) or \(\d+, 16\)"):
        logits(model, batches[0], head_mask=full_head_mask(model, rows=2))


# ------------------------------------------------------------------------------------ scores
def test_weight_norm_scores_are_query_row_norms_by_original_id(model):
    scores = weight_norm_scores(model)
    weight = model.fuser.stack.blocks[1].cross_attn.q_proj.weight  # head_dim 2: head 3 owns rows 6 and 7
    torch.testing.assert_close(scores[1, 3], weight[6:8].norm())
    pruned = prune_model(model, HEADS)
    after = weight_norm_scores(pruned)
    for layer, heads in HEADS.items():
        assert bool(after[layer, heads].isnan().all())
    kept = ~after.isnan()
    torch.testing.assert_close(after[kept], scores[kept])  # remaining heads keep their ids and scores
    averaged = weight_norm_scores(pruned, average_layers=True)
    torch.testing.assert_close(averaged[0, 4], (scores[0, 4] + scores[1, 4]) / 2)
    torch.testing.assert_close(averaged[1, 1], scores[1, 1])  # head 1 is left in layer 1 only
    assert bool(averaged[0, 1].isnan())


def test_gradient_score_equals_a_finite_difference_estimate():
    torch.manual_seed(0)
    model = VLFuseModel.from_config(tiny_config(fuser={"gated": False, "heads": 4}), ANSWERS, QUESTIONS).double().eval()
    batches = make_batches(seed=3)
    scores = gradient_scores(model, batches, normalize=False).double()

    eps, total, count = 1e-6, torch.zeros(2, 4, dtype=torch.float64), 0
    gates = full_head_mask(model)
    with torch.no_grad():
        for batch in batches:
            valid = batch["labels"] != IGNORE_INDEX

            def losses():  # per question
                return F.cross_entropy(logits(model, batch, head_mask=gates), batch["labels"], reduction="none")[valid]

            for layer in range(2):
                for head in range(4):
                    gates[layer, head] = 1 + eps
                    plus = losses()
                    gates[layer, head] = 1 - eps
                    minus = losses()
                    gates[layer, head] = 1.0
                    total[layer, head] += ((plus - minus) / (2 * eps)).abs().sum()  # per question, then |.|
            count += int(valid.sum())
    torch.testing.assert_close(scores, total / count, rtol=1e-6, atol=1e-9)
    assert float(scores.min()) > 0

    normalized = gradient_scores(model, batches).double()
    torch.testing.assert_close(normalized.norm(dim=1), torch.ones(2, dtype=torch.float64), rtol=1e-6, atol=0)
    torch.testing.assert_close(normalized, scores / scores.norm(dim=1, keepdim=True), rtol=1e-5, atol=0)


def test_gradient_scores_of_a_pruned_model_are_nan_where_heads_are_gone(model, batches):
    scores = gradient_scores(prune_model(model, HEADS), batches)
    for layer, heads in HEADS.items():
        assert bool(scores[layer, heads].isnan().all())
    assert int(scores.isnan().sum()) == 7
    torch.testing.assert_close(scores.nan_to_num(0).norm(dim=1), torch.ones(2))


def test_ablation_scores_are_the_accuracy_drop_of_pruning_one_head(model, batches):
    scores = ablation_scores(model, batches)
    assert evaluate(model, batches) == 1.0
    assert float(scores.max()) > 0  # not vacuous: some head matters
    for layer, head in [(0, 0), (0, 7), (1, 5), (1, 12)]:
        expected = 1.0 - evaluate(prune_model(model, {layer: [head]}), batches)
        assert math.isclose(float(scores[layer, head]), expected, abs_tol=1e-6)
    pruned_scores = ablation_scores(prune_model(model, HEADS), batches)
    assert int(pruned_scores.isnan().sum()) == 7


def test_evaluate_skips_ignored_labels(model, batches):
    wrong = [dict(b, labels=b["labels"].clone()) for b in batches]
    labels = wrong[0]["labels"]
    valid = labels != IGNORE_INDEX
    labels[valid] = (labels[valid] + 1) % len(ANSWERS)  # every answer of batch 0 now wrong
    n0 = int((batches[0]["labels"] != IGNORE_INDEX).sum())
    n1 = int((batches[1]["labels"] != IGNORE_INDEX).sum())
    assert math.isclose(evaluate(model, wrong), n1 / (n0 + n1))
    unlabelled = [dict(b, labels=torch.full_like(b["labels"], IGNORE_INDEX)) for b in batches]
    with pytest.raises(ValueError, match="no question with an answer"):
        evaluate(model, unlabelled)


def test_pruning_curve_equals_evaluating_physically_pruned_models(model, batches):
    scores = weight_norm_scores(model)
    fractions = [0.0, 0.25, 0.5, 0.9]
    curve = pruning_curve(model, scores, batches, fractions)
    assert [f for f, _ in curve] == fractions
    assert curve[0][1] == evaluate(model, batches)
    for fraction, accuracy in curve[1:]:
        expected = evaluate(prune_model(model, heads_to_prune(scores, fraction=fraction)), batches)
        assert math.isclose(accuracy, expected)
    assert model.training is False
