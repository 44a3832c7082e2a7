"""The bilinear head (the easy-VQA default): it learns products the pooled head cannot, and
keeps every guarantee of a fusion model (gradients, save/load, pruning, head scores)."""

import pytest
import torch
import torch.nn.functional as F

from vlfuse.analysis.head_scores import score_heads
from vlfuse.analysis.pruning import heads_to_prune, prune_model
from vlfuse.model import VLFuseModel
from vlfuse.heads import BilinearConfig, BilinearHead, PooledHead, QuadraticForms

from conftest import logits, make_model, parameters_without_gradient


def xor_of_a_match(n: int, colours: int = 6, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Pooled states ``(n, 1, 2 * colours + 1)``: a one-hot colour asked, a one-hot colour seen and a
    "negated" bit; the answer (0 no, 1 yes) is "asked == seen" exclusive-or "negated", as easy-VQA's
    yes/no questions."""
    g = torch.Generator().manual_seed(seed)
    asked = torch.randint(0, colours, (n,), generator=g)
    # Half the questions name the colour that is there, as in a balanced set.
    seen = torch.where(torch.rand(n, generator=g) < 0.5, asked, torch.randint(0, colours, (n,), generator=g))
    negated = torch.randint(0, 2, (n,), generator=g)
    states = torch.cat([F.one_hot(asked, colours), F.one_hot(seen, colours), negated[:, None]], dim=1).float()
    answers = ((asked == seen).long() ^ negated).long()
    return states[:, None, :], answers


def train_head(head: torch.nn.Module, steps: int = 300) -> float:
    """Accuracy on held-out states after ``steps`` of Adam on the toy task."""
    states, answers = xor_of_a_match(512)
    mask = torch.ones(states.shape[:2], dtype=torch.bool)
    opt = torch.optim.Adam(head.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(head(states, mask), answers).backward()
        opt.step()
    test_states, test_answers = xor_of_a_match(512, seed=1)
    with torch.no_grad():
        predicted = head.eval()(test_states, torch.ones(test_states.shape[:2], dtype=torch.bool)).argmax(-1)
    return (predicted == test_answers).float().mean().item()


def test_the_bilinear_head_learns_a_negated_comparison_that_the_pooled_head_cannot(one_thread):
    torch.manual_seed(0)
    bilinear = train_head(BilinearHead(13, 2, dropout=0.0))
    torch.manual_seed(0)
    pooled = train_head(PooledHead(13, 2, dropout=0.0))
    assert bilinear > 0.97
    assert pooled < 0.8  # a linear function of the state: about the 3/4 that one feature gives


def test_quadratic_forms_compute_what_nn_bilinear_computes_on_a_vector_and_itself():
    torch.manual_seed(0)
    forms, reference = QuadraticForms(6, 4), torch.nn.Bilinear(6, 6, 4, bias=False)
    with torch.no_grad():
        forms.weight.normal_()
        reference.weight.copy_(forms.weight)
    h = torch.randn(5, 6)
    torch.testing.assert_close(forms(h), reference(h, h))


def test_the_products_start_at_zero_and_every_parameter_gets_a_gradient():
    model, batch = make_model(head={"type": "bilinear"}, fuser={"gated": False})  # tanh gates at 0 would block the image side
    assert isinstance(model.head, BilinearHead)
    assert torch.count_nonzero(model.head.products.weight) == 0
    F.cross_entropy(logits(model, batch), batch["labels"]).backward()
    missing = parameters_without_gradient(model)
    assert missing == []


def test_a_bilinear_model_saves_and_loads_with_identical_logits(tmp_path):
    model, batch = make_model(head={"type": "bilinear"})
    with torch.no_grad():
        model.head.products.weight.normal_()  # trained-looking, not the zero start
    loaded = VLFuseModel.from_pretrained(model.save_pretrained(tmp_path / "model"))
    assert loaded.config.head == BilinearConfig(dropout=0.0)
    assert isinstance(loaded.head, BilinearHead)
    with torch.no_grad():
        torch.testing.assert_close(logits(loaded.eval(), batch), logits(model.eval(), batch), rtol=0, atol=1e-6)


@pytest.mark.parametrize("score", ["gradient", "ablation"])
def test_heads_of_a_bilinear_model_are_scored_and_pruned(score):
    model, batch = make_model(head={"type": "bilinear"})
    scores = score_heads(model.eval(), score, [batch])
    assert scores.shape == (2, 16) and torch.isfinite(scores).all()
    pruned = prune_model(model, heads_to_prune(scores, fraction=0.25))
    assert sum(block.cross_attn.num_heads for block in pruned.fuser.stack.blocks) == 24
    assert logits(pruned.eval(), batch).shape == logits(model, batch).shape
