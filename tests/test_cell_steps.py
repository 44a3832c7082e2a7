"""The cell-steps fuser (``fuser: {type: cell_steps}``; configs/shapes_fusion.yaml uses its
cell_moves variant): a one-number state per grid cell, updated word by word by one shared 16-head
fusion block, read by the existence head. The shared block's
cross-attention is the fuser's one attention layer: its heads are masked, drawn and pruned."""

import copy

import pytest
import torch

from vlfuse.encoders import TextEncoderConfig
from vlfuse.fusers import CellStepsConfig, CellStepsFuser
from vlfuse.heads import ExistenceHead
from vlfuse.model import VLFuseModel

from conftest import parameters_without_gradient, reader_config, tiny_config

QUESTIONS = ["is a red shape a square", "is a circle left of a square", "is a circle red"]


def cell_steps_model(**options) -> VLFuseModel:
    config = reader_config("cell_steps", mlp="swiglu", output_gate=True, dropout=0.0, **options)
    torch.manual_seed(0)
    return VLFuseModel.from_config(config, ["false", "true"], QUESTIONS)


def answer(model: VLFuseModel, pixels: torch.Tensor, questions: list[str], index: torch.Tensor, **kwargs):
    tokens = model.processor.tokenize(questions)
    return model(pixels, tokens["input_ids"], tokens["attention_mask"], image_index=index, **kwargs)


def test_every_parameter_gets_a_gradient_and_the_step_has_16_heads():
    model = cell_steps_model()
    assert isinstance(model.fuser, CellStepsFuser) and isinstance(model.head, ExistenceHead)
    assert model.fuser.step.cross_attn.num_heads == 16
    logits = answer(model, torch.rand(2, 3, 32, 32), QUESTIONS, torch.tensor([0, 1, 1])).logits
    assert logits.shape == (3, 2) and torch.isfinite(logits).all()
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 1])).backward()
    unused = "text_encoder.model.embeddings."  # it reads word embeddings only: no positions, no embedding norm
    missing = parameters_without_gradient(model)
    assert [name for name in missing if not name.startswith(unused) or "word_embeddings" in name] == []
    assert "text_encoder.model.embeddings.word_embeddings.weight" not in missing


def test_padding_of_the_question_does_not_change_the_answer():
    model = cell_steps_model().eval()
    pixels = torch.rand(3, 3, 32, 32)
    with torch.no_grad():
        together = answer(model, pixels, QUESTIONS, torch.arange(3)).logits  # padded to the longest question
        for i, question in enumerate(QUESTIONS):
            alone = answer(model, pixels[i : i + 1], [question], torch.zeros(1, dtype=torch.long)).logits
            torch.testing.assert_close(alone[0], together[i], atol=1e-5, rtol=0)


def test_the_answer_is_the_existence_of_the_final_set():
    """An empty set (every cell's m near 0) answers false; the full start set answers true."""
    head = cell_steps_model().head
    full = head(torch.logsumexp(torch.zeros(1, 16), dim=1), None)
    empty = head(torch.logsumexp(torch.full((1, 16), -30.0), dim=1), None)
    assert full.argmax(-1).item() == 1 and empty.argmax(-1).item() == 0


def test_saves_and_loads_with_identical_logits(tmp_path):
    model = cell_steps_model().eval()
    pixels, index = torch.rand(2, 3, 32, 32), torch.tensor([0, 1, 1])
    loaded = VLFuseModel.from_pretrained(model.save_pretrained(tmp_path / "model")).eval()
    assert loaded.config.fuser == CellStepsConfig(mlp="swiglu", output_gate=True, dropout=0.0)
    assert loaded.config.head.type == "existence"
    with torch.no_grad():
        got = answer(loaded, pixels, QUESTIONS, index).logits
        torch.testing.assert_close(got, answer(model, pixels, QUESTIONS, index).logits, rtol=0, atol=0)


@pytest.mark.parametrize("answers", [["no", "yes", "red"], ["yes"]])
def test_it_needs_two_answers(answers):
    with pytest.raises(ValueError, match="two answers|at least 2 answers"):
        VLFuseModel.from_config(reader_config("cell_steps"), answers, QUESTIONS)


def test_it_refuses_text_layers_it_would_not_use():
    text = TextEncoderConfig(width=32, depth=2, num_heads=2, max_length=16)
    with pytest.raises(ValueError, match="fuser 'cell_steps' .* set text.depth to 0"):
        tiny_config(text=text, fuser={"type": "cell_steps"}, head={"type": "existence"})


# ------------------------------------------------------------------ its attention heads
def test_its_one_attention_layer_is_the_shared_blocks_cross_attention():
    model = cell_steps_model()
    assert model.attention_layers == [model.fuser.step.cross_attn]
    assert model.has_fusion_heads and model.num_fusion_layers == 1 and model.num_heads_built == 16
    assert model.fusion_head_ids == [list(range(16))]


def test_a_zero_head_mask_on_a_head_gives_the_logits_of_the_model_without_it():
    model = cell_steps_model().eval()
    pixels, index = torch.rand(2, 3, 32, 32), torch.tensor([0, 1, 1])
    pruned = copy.deepcopy(model)
    pruned.prune_heads({0: [5]})
    mask = torch.ones(1, 16)
    mask[0, 5] = 0.0
    with torch.no_grad():
        full = answer(model, pixels, QUESTIONS, index).logits
        masked = answer(model, pixels, QUESTIONS, index, head_mask=mask).logits
        without = answer(pruned, pixels, QUESTIONS, index).logits
        per_question = mask.expand(3, 1, 16).clone()
        per_question[1:] = 1.0  # only the first question loses the head
        mixed = answer(model, pixels, QUESTIONS, index, head_mask=per_question).logits
    torch.testing.assert_close(masked, without, atol=1e-5, rtol=0)
    assert not torch.allclose(masked, full, atol=1e-5, rtol=0)  # the head matters: the test can fail
    torch.testing.assert_close(mixed[0], without[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(mixed[1:], full[1:], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"head_mask must be \(layers, heads\) \(1, 16\)"):
        answer(model, pixels, QUESTIONS, index, head_mask=torch.ones(2, 16))


def test_its_attention_weights_are_rows_over_the_patches_zero_at_padding():
    model = cell_steps_model().eval()
    pixels, index = torch.rand(2, 3, 32, 32), torch.tensor([0, 1, 1])
    tokens = model.processor.tokenize(QUESTIONS)
    real = tokens["attention_mask"].bool()
    assert not real.all()  # the questions differ in length: some positions are padding
    with torch.no_grad():
        out = answer(model, pixels, QUESTIONS, index, weights_from=[0])
        plain = answer(model, pixels, QUESTIONS, index)
    weights = out.attentions[0]
    lt, cells = tokens["input_ids"].shape[1], 16  # a 4x4 grid of patches, no prefix token
    assert set(out.attentions) == {0} and weights.shape == (3, 16, lt, cells)
    assert (weights >= 0).all()
    sums = weights.sum(-1)  # (Bq, H, Lt)
    torch.testing.assert_close(sums[real[:, None, :].expand_as(sums)], torch.ones(int(real.sum()) * 16))
    assert torch.equal(weights[~real[:, None, :].expand_as(sums)], torch.zeros(int((~real).sum()) * 16, cells))
    torch.testing.assert_close(out.logits, plain.logits, atol=1e-6, rtol=0)  # drawing them changes nothing
    with pytest.raises(ValueError, match=r"attention layers \[1\] out of range"):
        answer(model, pixels, QUESTIONS, index, weights_from=[1])


def test_prune_heads_removes_them_for_real_and_they_stay_removed_when_saved(tmp_path):
    model = cell_steps_model().eval()
    attention = model.fuser.step.cross_attn
    before = sum(p.numel() for p in model.parameters())
    q_rows = attention.q_proj.weight.shape[0]
    model.prune_heads({0: [3, 7]})
    attention = model.fuser.step.cross_attn
    assert attention.num_heads == 14 and model.fusion_head_ids == [[h for h in range(16) if h not in (3, 7)]]
    assert attention.q_proj.weight.shape[0] == q_rows * 14 // 16
    assert attention.out_proj.weight.shape[1] == q_rows * 14 // 16
    assert sum(p.numel() for p in model.parameters()) < before
    assert model.config.pruned_heads == {"0": [3, 7]}
    assert model.num_heads_built == 16  # head masks keep indexing original ids
    pixels, index = torch.rand(2, 3, 32, 32), torch.tensor([0, 1, 1])
    with torch.no_grad():
        out = answer(model, pixels, QUESTIONS, index, weights_from=[0])
        assert out.attentions[0].shape[1] == 14
        loaded = VLFuseModel.from_pretrained(model.save_pretrained(tmp_path / "pruned")).eval()
        assert loaded.fuser.step.cross_attn.num_heads == 14
        # the same path as `out` (weights asked for): SDPA and the explicit path differ by rounding with 2+ threads
        torch.testing.assert_close(answer(loaded, pixels, QUESTIONS, index, weights_from=[0]).logits, out.logits, rtol=0, atol=0)


def test_states_trace_the_set_word_by_word_and_end_at_the_set_the_answer_reads():
    model = cell_steps_model().eval()
    pixels, index = torch.rand(2, 3, 32, 32), torch.tensor([0, 1, 1])
    tokens = model.processor.tokenize(QUESTIONS)
    mask = tokens["attention_mask"].bool()
    with torch.no_grad():
        text = model.fuser.question_features(model.text_encoder, tokens["input_ids"], mask)
        patches = model.fuser.image_context(model.embed_images(pixels), model.image_encoder.num_prefix_tokens)
        states = model.fuser.states(text, mask, patches, index)  # (3, Lt, cells)
        evidence = model.fuser(text, mask, patches, index).output
    assert states.shape == (3, mask.shape[1], patches.shape[1])
    assert ((states > 0) & (states <= 1)).all()
    torch.testing.assert_close(states[:, 0].log().logsumexp(-1), evidence)
    last = mask.sum(1) - 1  # the first word read; padding after it repeats the full start set
    for q in range(3):
        assert torch.equal(states[q, last[q] + 1 :], torch.ones_like(states[q, last[q] + 1 :]))
        assert not torch.equal(states[q, last[q]], torch.ones_like(states[q, last[q]]))


def test_the_find_can_have_fewer_wider_heads_than_the_shared_block():
    model = cell_steps_model(find_heads=4)
    fuser = model.fuser
    assert fuser.step.cross_attn.num_heads == 16 and fuser.find_heads == 4
    patches, words = torch.randn(3, 4, 32), torch.randn(3, 5, 32)  # the tiny config's fusion width, 32
    assert fuser.find_keys(patches).shape == (3, 4, 4, 8)
    assert fuser.finds(words, patches).shape == (3, 5, 4, 4)
    logits = answer(model, torch.rand(2, 3, 32, 32), QUESTIONS, torch.tensor([0, 1, 1])).logits
    torch.nn.functional.cross_entropy(logits, torch.tensor([0, 1, 1])).backward()
    assert fuser.find_in.weight.grad.shape == (32, 4) and fuser.find_in.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("options, message", [
    ({"find_heads": 0}, "fuser.find_heads must be between 1 and"),
    ({"find_heads": 5}, r"fuser.find_heads \(5\) must divide the fusion width \(32\)"),
    ({"find_diversity_weight": -1.0}, "fuser.find_diversity_weight must be >= 0, got -1.0"),
])
def test_bad_find_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        cell_steps_model(**options)


def set_find_queries(fuser: CellStepsFuser, direction_of: dict[int, torch.Tensor]) -> None:
    """Make the find query of a token whose features are the one-hot of ``i`` point along
    ``direction_of[i]`` (the same in every head; the head norm without its affine part)."""
    with torch.no_grad():
        fuser.find_query.weight.zero_()
        fuser.find_query.bias.zero_()
        fuser.head_norm.weight.fill_(1.0)
        fuser.head_norm.bias.zero_()
        for i, direction in direction_of.items():
            fuser.find_query.weight[:, i] = direction.repeat(fuser.find_heads)


def test_the_find_query_overlap_is_zero_for_opposite_words_one_for_alike_and_counts_a_word_once():
    fuser = cell_steps_model(find_heads=4).fuser
    up = torch.tensor([1.0, -1.0] * 4)  # one head's 8 dims, mean 0 and variance 1: the head norm keeps it
    set_find_queries(fuser, {0: up, 1: -up, 2: up})
    one_hot = torch.eye(32)
    mask = torch.tensor([[True, True, True, False]])
    opposite = torch.stack([one_hot[0], one_hot[1], one_hot[0], one_hot[3]])[None]  # word 0 twice, padding
    assert fuser.find_query_overlap(opposite, mask) == 0
    alike = torch.stack([one_hot[0], one_hot[2], one_hot[2], one_hot[3]])[None]
    torch.testing.assert_close(fuser.find_query_overlap(alike, mask), torch.tensor(1.0))
    three = torch.stack([one_hot[0], one_hot[1], one_hot[2], one_hot[3]])[None]  # pairs: -1, 1, -1 (each both ways)
    torch.testing.assert_close(fuser.find_query_overlap(three, mask), torch.tensor(1 / 3))
    assert fuser.find_query_overlap(alike, torch.tensor([[True, False, False, False]])) == 0


def test_the_find_diversity_penalty_is_added_in_training_only_and_pushes_the_queries():
    model = cell_steps_model(find_diversity_weight=0.5)
    pixels, index = torch.rand(2, 3, 32, 32), torch.tensor([0, 1, 1])
    output = answer(model.train(), pixels, QUESTIONS, index)
    text = model.encode_questions(*model.processor.tokenize(QUESTIONS).values())
    mask = model.processor.tokenize(QUESTIONS)["attention_mask"].bool()
    torch.testing.assert_close(output.auxiliary_loss, 0.5 * model.fuser.find_query_overlap(text, mask))
    assert output.auxiliary_loss > 0
    output.auxiliary_loss.backward()
    assert model.fuser.find_query.weight.grad.abs().sum() > 0
    with torch.no_grad():
        assert answer(model.eval(), pixels, QUESTIONS, index).auxiliary_loss is None
    assert answer(cell_steps_model().train(), pixels, QUESTIONS, index).auxiliary_loss is None
