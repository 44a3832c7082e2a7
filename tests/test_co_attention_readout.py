"""The co-attention readout (configs/shapes_fusion.yaml): the patches read the fused question and each
other; it keeps every guarantee of a fusion model (gradients, shared images, save/load, pruning)."""

import pytest
import torch
import torch.nn.functional as F

from vlfuse.analysis.head_scores import score_heads
from vlfuse.analysis.pruning import heads_to_prune, prune_model
from vlfuse.model import FUSION_OPTIONS, VLFuseModel
from vlfuse.readouts import CoAttentionReadout

from conftest import logits, make_model, parameters_without_gradient


def test_it_has_a_second_stack_of_16_head_blocks_with_the_patches_as_queries():
    model, batch = make_model(readout="co_attention")
    readout = model.readout
    assert isinstance(readout, CoAttentionReadout)
    assert len(readout.patch_blocks) == model.config.fusion_depth
    assert all(block.self_attn is not None and block.cross_attn.num_heads == 16 for block in readout.patch_blocks.blocks)
    context = model.encode_images(batch["pixel_values"])
    assert context.readout.shape == (4, 16, 32)  # the 4x4 grid, without the class token


def test_every_parameter_gets_a_gradient():
    model, batch = make_model(readout="co_attention", gated=False)  # tanh gates at 0 would block a side
    F.cross_entropy(logits(model, batch), batch["labels"]).backward()
    missing = parameters_without_gradient(model)
    assert missing == []


def test_shared_images_give_the_same_logits_as_repeated_images():
    model, batch = make_model(readout="co_attention", gated=False)
    model.eval()
    tokens = model.tokenize(batch["questions"])
    repeated = model(batch["pixel_values"][batch["image_index"]], **tokens).logits
    torch.testing.assert_close(logits(model, batch), repeated, atol=1e-5, rtol=0)


def test_padding_of_the_question_does_not_change_the_answer():
    """A question scored alone equals the same question in a batch padded to a longer one."""
    model, batch = make_model(readout="co_attention", gated=False)
    model.eval()
    with torch.no_grad():
        together = logits(model, batch)
        for i, question in enumerate(batch["questions"]):
            image = batch["pixel_values"][batch["image_index"][i]][None]
            alone = model(image, **model.tokenize([question])).logits
            torch.testing.assert_close(alone[0], together[i], atol=1e-5, rtol=0)


def test_saves_and_loads_with_identical_logits(tmp_path):
    model, batch = make_model(readout="co_attention", gated=False)
    loaded = VLFuseModel.from_pretrained(model.save_pretrained(tmp_path / "model"))
    assert loaded.config.readout == "co_attention"
    with torch.no_grad():
        torch.testing.assert_close(logits(loaded.eval(), batch), logits(model.eval(), batch), rtol=0, atol=0)


def test_every_fusion_option_reaches_its_blocks():
    changed = dict(fusion_heads=8, mlp_ratio=1.0, dropout=0.2, attn_dropout=0.1, text_self_attention=False,
                   gated=False, attention_normalizer="leaky_relu", diversity_weight=0.5, output_gate=True,
                   mlp_type="swiglu", pruned_heads={"0": [1]})
    assert sorted(changed) == sorted(FUSION_OPTIONS)
    model, _ = make_model(readout="co_attention", **changed)
    block = model.readout.patch_blocks.blocks[0]
    assert block.cross_attn.num_heads == 8 and block.cross_attn.gate_proj is not None
    assert block.gate_attn is None and type(block.mlp).__name__ == "SwiGLU"


@pytest.mark.parametrize("score", ["gradient", "ablation"])
def test_heads_of_a_co_attention_model_are_scored_and_pruned(score):
    model, batch = make_model(readout="co_attention")
    scores = score_heads(model.eval(), score, [batch])
    assert scores.shape == (2, 16) and torch.isfinite(scores).all()
    pruned = prune_model(model, heads_to_prune(scores, fraction=0.25))
    assert sum(block.cross_attn.num_heads for block in pruned.fusion.blocks) == 24
    assert logits(pruned.eval(), batch).shape == logits(model, batch).shape
