"""The default model of configs/easy_vqa.yaml at its real size (16 heads of 4 dimensions, one block
per encoder, no dropout) keeps every guarantee of a fusion model: finite scores over padded
questions, a gradient for every parameter, identical scores after save/load, heads that are scored
and pruned."""

import pytest
import torch
import torch.nn.functional as F

from vlfuse.analysis.data import read_config
from vlfuse.analysis.head_scores import score_heads
from vlfuse.analysis.pruning import heads_to_prune, prune_model
from vlfuse.model import VLFuseConfig, VLFuseModel

from conftest import COLOUR_ANSWERS, REPO, logits, parameters_without_gradient, toy_batch

DEFAULT_CONFIG = REPO / "configs" / "easy_vqa.yaml"


@pytest.fixture(scope="module")
def architecture() -> VLFuseConfig:
    return VLFuseConfig.from_dict(read_config(DEFAULT_CONFIG)["model"]["architecture"])


@pytest.fixture
def model_and_batch(architecture) -> tuple[VLFuseModel, dict]:
    torch.manual_seed(0)
    _, batch = toy_batch(size=architecture.image.image_size)
    batch["questions"][0] = "what color is the shape in the middle of this image?"  # longer: the rest is padded
    return VLFuseModel.from_config(architecture, COLOUR_ANSWERS, batch["questions"]), batch


def test_the_default_is_sixteen_heads_over_two_fusion_blocks(architecture):
    assert (architecture.fuser.type, architecture.head.type) == ("fusion_stack", "bilinear")
    assert (architecture.fuser.heads, architecture.fuser.depth) == (16, 2)
    assert architecture.fusion_dim % architecture.fuser.heads == 0
    assert architecture.fusion_dim // architecture.fuser.heads == 4


def test_padded_questions_give_finite_scores_and_every_parameter_a_gradient(model_and_batch):
    model, batch = model_and_batch
    lengths = model.processor.tokenize(batch["questions"])["attention_mask"].sum(1)
    assert lengths.min() < lengths.max()  # the batch pads some questions
    scores = logits(model.train(), batch)
    assert torch.isfinite(scores).all()
    F.cross_entropy(scores, batch["labels"]).backward()
    missing = parameters_without_gradient(model)
    assert missing == []


def test_save_and_load_give_identical_scores(model_and_batch, tmp_path):
    model, batch = model_and_batch
    with torch.no_grad():
        model.head.products.weight.normal_()  # trained-looking, not the zero start
    loaded = VLFuseModel.from_pretrained(model.save_pretrained(tmp_path / "model"))
    with torch.no_grad():
        torch.testing.assert_close(logits(loaded.eval(), batch), logits(model.eval(), batch), rtol=0, atol=1e-6)


def test_heads_are_scored_and_a_quarter_pruned(model_and_batch):
    model, batch = model_and_batch
    scores = score_heads(model.eval(), "gradient", [batch])
    assert scores.shape == (2, 16) and torch.isfinite(scores).all()
    pruned = prune_model(model, heads_to_prune(scores, fraction=0.25))
    assert sum(block.cross_attn.num_heads for block in pruned.fuser.stack.blocks) == 24
    assert torch.isfinite(logits(pruned.eval(), batch)).all()
