"""Explanations (vlfuse.analysis.explain), ``vlfuse explain`` and the pointing game: shapes, hand
computations of attention x gradient and rollout, the files the command writes, its errors."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from vlfuse.analysis.explain import (
    METHODS, MethodRefused, explain, log_odds, occluded_images, untrained_copy, weights_gradient,
)
from vlfuse.cli import main as vlfuse_main
from vlfuse.layers import attention as attention_module
from vlfuse.model import VLFuseModel

from conftest import SHARED, load_script, reader_config, tiny_config

ANSWERS = ["no", "yes", "red", "blue", "green", "circle"]
QUESTIONS = ["what color is the shape?", "is there a red shape?", "what shape is it?"]
QUESTION = "what color is the shape?"
HEADS, PREFIX, GRID = 16, 1, (4, 4)  # tiny_config: 16 fusion heads, a CLS token, 32 px / 8 px patches
TOKENS = 8  # [CLS] what color is the shape ? [SEP], and "?" is a word of its own: 8 as the word tokenizer splits QUESTION

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_model(depth: int = 2, **fuser) -> VLFuseModel:
    torch.manual_seed(0)
    config = tiny_config(fuser={"gated": False, "self_attention": False, "depth": depth, **fuser})
    return VLFuseModel.from_config(config, ANSWERS, QUESTIONS).eval()


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def image():
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8))


CELL_READER_METHODS = ("find_gradient", "reader_set", "word_set")  # the SHAPES cell readers only
FUSION_STACK_METHODS = [m for m in METHODS if m not in CELL_READER_METHODS]
TOKENLESS_METHODS = ("input_gradient", "occlusion")  # one map for the question, no heads, no tokens


@pytest.mark.parametrize("method", FUSION_STACK_METHODS)
def test_each_method_gives_maps_per_head_and_token_and_a_question_map_that_sums_to_1(model, image, method):
    e = explain(model, image, QUESTION, method)
    assert e.method == method and e.answer in ANSWERS and 0 < e.probability <= 1
    assert len(e.tokens) == TOKENS and e.tokens[0] == "[CLS]"
    li = PREFIX + GRID[0] * GRID[1]
    assert e.question_map.shape == (li,) and (e.question_map >= 0).all()
    assert e.question_map.sum() == pytest.approx(1.0, abs=1e-5)
    assert e.patch_map().shape == GRID
    heads = HEADS if method in ("attention", "gradcam") else 1
    if method in TOKENLESS_METHODS:
        assert e.token_maps is None and e.token_patch_maps() is None
        assert e.question_map[:PREFIX].sum() == 0  # the prefix tokens have no pixels
    else:
        assert e.token_maps.shape == (heads, TOKENS, li) and len(e.heads) == heads
        assert e.token_patch_maps().shape == (heads, TOKENS, *GRID)
    assert e.layer == (1 if method in ("attention", "gradcam") else None)


def test_raw_attention_rows_are_the_models_weights(model, image):
    e = explain(model, image, QUESTION, "attention", layer=0)
    inputs = model.processor([image], [QUESTION])
    weights = model(**inputs, weights_from=[0]).attentions[0][0]  # (H, Lt, Li)
    np.testing.assert_allclose(e.token_maps, weights.detach().numpy(), atol=1e-6)
    np.testing.assert_allclose(e.token_maps.sum(-1), 1.0, atol=1e-5)  # each row a distribution
    np.testing.assert_allclose(e.question_map, weights.mean((0, 1)).detach().numpy(), atol=1e-6)


def test_weights_gradient_of_a_hand_built_two_head_layer():
    """``y = sum_q c[h, q] . (A V)[h, q]``: by hand, ``dy/dA[h, q, k] = c[h, q] . V[h, k]``."""
    torch.manual_seed(1)
    heads, tokens, keys, dim = 2, 3, 5, 4
    attention = torch.randn(heads, tokens, keys).softmax(-1)
    value = torch.randn(heads, keys, dim)
    c = torch.randn(heads, tokens, dim)
    value_grad = attention.transpose(1, 2) @ c  # dy/dV = A^T c
    by_hand = torch.einsum("hqd,hkd->hqk", c, value)
    torch.testing.assert_close(weights_gradient(attention, value, value_grad), by_hand, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float64, 1e-9), (torch.float32, 1e-2)])
def test_gradcam_is_attention_times_the_positive_gradient_of_the_answers_logit(image, monkeypatch, dtype, tolerance):
    """Against the gradient at the weights the layer used (kept by wrapping the attention core).

    Exact in float64; in float32 the rounding of dy/dV is amplified by how alike the tokens'
    attention rows are (nearly uniform in an untrained model: under 1% of the largest value).
    """
    model = tiny_model().to(dtype)
    used = []

    def keep_weights(*args, original=attention_module.attention_core, **kwargs):
        out, weights = original(*args, **kwargs)
        if weights is not None:
            weights.retain_grad()
            used.append(weights)
        return out, weights

    monkeypatch.setattr(attention_module, "attention_core", keep_weights)
    inputs = model.processor([image], [QUESTION]).to(dtype=dtype)
    logits = model(**inputs, weights_from=[1]).logits[0]
    answer = int(logits.argmin())  # not the predicted one
    logits[answer].backward()
    [weights] = used  # (1, H, T, Li): one image, its question's tokens in order
    monkeypatch.undo()
    e = explain(model, image, QUESTION, "gradcam", answer=ANSWERS[answer])
    assert e.answer_index == answer
    by_hand = (weights.detach() * weights.grad.clamp_min(0))[0].float().numpy()
    scale = np.abs(by_hand).max()
    h = 3
    np.testing.assert_allclose(e.token_maps[h], by_hand[h], atol=tolerance * scale)
    np.testing.assert_allclose(e.token_maps, by_hand, atol=tolerance * scale)
    assert (by_hand > 0).any() and (by_hand == 0).any()  # the positive part, not all of it


def test_each_occluded_image_differs_from_the_image_in_its_own_patch_painted_the_median_colour():
    pixels = torch.rand(3, 10, 11) / 2
    pixels[:, :, 4:] = torch.tensor([0.9, 0.8, 0.7])[:, None, None]  # most of the image one colour: the median
    occluded = occluded_images(pixels, (2, 3))  # 10 x 11 pixels: rows 0-4 and 5-9, columns 0-2, 3-6 and 7-10
    assert occluded.shape == (6, 3, 10, 11)
    spans = [(slice(0, 5), slice(0, 3)), (slice(0, 5), slice(3, 7)), (slice(0, 5), slice(7, 11)),
             (slice(5, 10), slice(0, 3)), (slice(5, 10), slice(3, 7)), (slice(5, 10), slice(7, 11))]
    for image, (rows, cols) in zip(occluded, spans):
        expected = pixels.clone()
        expected[:, rows, cols] = torch.tensor([0.9, 0.8, 0.7])[:, None, None]
        assert torch.equal(image, expected)


def test_occlusion_is_how_much_painting_each_patch_changes_the_answers_log_odds_either_way(model, image):
    e = explain(model, image, QUESTION, "occlusion", answer="blue")
    pixels = model.processor.image(image)
    tokens = model.processor.tokenize([QUESTION] * 16)
    blue = ANSWERS.index("blue")
    with torch.no_grad():
        def odds(images):  # log(p / (1 - p)) of "blue", from the probabilities
            p = model(images, **tokens).logits.double().softmax(-1)[:, blue]
            return (p / (1 - p)).log()

        changes = odds(occluded_images(pixels, GRID)) - odds(pixels[None].expand(16, -1, -1, -1))  # (16,)
    assert (changes < 0).any() and (changes > 0).any()  # painting lowers the odds here, raises them there
    assert e.answer == "blue" and e.question_map[:PREFIX].sum() == 0
    np.testing.assert_allclose(e.question_map[PREFIX:], (changes.abs() / changes.abs().sum()).numpy(), atol=1e-5)


def test_log_odds_of_a_confident_answer_do_not_round_away_and_take_a_class_per_row():
    logits = torch.tensor([[30.0, 0.0, -2.0], [0.0, 0.0, 0.0]])  # p = 1 - 1e-13 rounds to 1 in float32
    np.testing.assert_allclose(log_odds(logits, 0), [30 - np.log(1 + np.exp(-2)), -np.log(2)], rtol=1e-6)
    np.testing.assert_allclose(log_odds(logits, torch.tensor([2, 1])), [-2 - np.log(np.exp(30) + 1), -np.log(2)], rtol=1e-6)


def test_occlusion_encodes_its_images_in_batches_and_gives_the_same_map(model, image, monkeypatch):
    whole = explain(model, image, QUESTION, "occlusion")
    monkeypatch.setattr("vlfuse.analysis.explain.OCCLUSION_BATCH", 5)  # 16 patches: batches of 5, 5, 5, 1
    np.testing.assert_allclose(explain(model, image, QUESTION, "occlusion").question_map, whole.question_map, atol=1e-6)


def test_the_cost_benchmark_times_every_method_the_model_takes_each_round(model):
    bench = load_script("bench_explain")
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    seconds, refused = bench.time_methods(model, image, rounds=2)
    assert list(seconds) == FUSION_STACK_METHODS and all(len(t) == 2 and min(t) > 0 for t in seconds.values())
    assert list(refused) == list(CELL_READER_METHODS)


def test_rollout_of_one_layer_is_its_head_mean_attention(image):
    one = tiny_model(depth=1)
    rolled = explain(one, image, QUESTION, "rollout")
    attention = explain(one, image, QUESTION, "attention")
    np.testing.assert_allclose(rolled.token_maps[0], attention.token_maps.mean(0), atol=1e-6)


def test_rollout_of_two_layers_weights_the_later_layer_twice(model, image):
    """``r = 0.5 (0.5 A0) + 0.5 A1``, normalised: ``A0 / 3 + 2 A1 / 3`` (the head means)."""
    rolled = explain(model, image, QUESTION, "rollout").token_maps[0]
    a0, a1 = (explain(model, image, QUESTION, "attention", layer=i).token_maps.mean(0) for i in (0, 1))
    np.testing.assert_allclose(rolled, a0 / 3 + 2 * a1 / 3, atol=1e-6)


def test_rollout_refuses_a_fuser_with_text_self_attention(image):
    with pytest.raises(ValueError, match="rollout.*self-attention"):
        explain(tiny_model(self_attention=True), image, QUESTION, "rollout")


def test_an_answer_or_method_or_layer_the_model_lacks_is_a_clear_error(model, image):
    with pytest.raises(ValueError, match=r"answer 'purple' is not one of the model's 6 answers: 'no', 'yes'"):
        explain(model, image, QUESTION, "gradcam", answer="purple")
    with pytest.raises(ValueError, match="unknown explanation method 'lime': choose from attention, gradcam"):
        explain(model, image, QUESTION, "lime")
    with pytest.raises(ValueError, match=r"layer 2 out of range: the model has fusion layers 0\.\.1"):
        explain(model, image, QUESTION, "attention", layer=2)


@pytest.fixture(scope="module")
def saved(model, image, tmp_path_factory):
    folder = tmp_path_factory.mktemp("explain")
    image.save(folder / "shape.png")
    return model.save_pretrained(folder / "model"), folder / "shape.png"


def test_the_command_writes_figures_maps_and_sidecar_and_prints_where(saved, tmp_path, capsys):
    model_dir, image_path = saved
    out = tmp_path / "maps"
    argv = ["explain", "--model", str(model_dir), "--image", str(image_path), "--question", QUESTION,
            "--answer", "red", "--output", str(out)]
    assert vlfuse_main(argv) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("answer: red (probability ")
    pngs = [f"shape_{m}_question.png" for m in FUSION_STACK_METHODS]
    pngs += [f"shape_{m}_words.png" for m in FUSION_STACK_METHODS if m not in TOKENLESS_METHODS]
    for name in pngs + ["shape.npz", "shape.json"]:
        assert (out / name).is_file() and str(out / name) in printed.err, name
    assert "skipped find_gradient: method 'find_gradient' reads a cell reader" in printed.err
    assert not (out / "shape_find_gradient_question.png").exists()
    assert f"wrote {len(pngs) + 2} files to {out}" in printed.err
    with np.load(out / "shape.npz") as maps:
        assert maps["gradcam_tokens"].shape == (HEADS, TOKENS, PREFIX + 16)
        assert maps["rollout_question"].sum() == pytest.approx(1.0, abs=1e-5)
        assert "input_gradient_tokens" not in maps and "occlusion_tokens" not in maps
    sidecar = json.loads((out / "shape.json").read_text())
    assert sidecar["answer"] == "red" and len(sidecar["tokens"]) == TOKENS
    assert sidecar["methods"]["gradcam"]["layer"] == 1 and sidecar["methods"]["rollout"]["layer"] is None


def test_the_command_refuses_an_unknown_answer_in_one_line(saved, tmp_path, capsys):
    model_dir, image_path = saved
    argv = ["explain", "--model", str(model_dir), "--image", str(image_path), "--question", QUESTION,
            "--answer", "purple", "--method", "gradcam", "--output", str(tmp_path / "maps")]
    assert vlfuse_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "answer 'purple' is not one of the model's 6 answers" in err
    assert not (tmp_path / "maps").exists()


def test_pointing_on_easy_vqa_val_reads_the_images_fit_holds_out_and_only_what_questions():
    from vlfuse.data.easy_vqa import question_kind
    from vlfuse.datamodules import EasyVQADataModule

    pointing = load_script("pointing_game")
    held_out = EasyVQADataModule().load_records("val")[:2]
    items = list(pointing.easy_vqa_items(2, split="val"))
    expected = [q for r in held_out for q in r.questions if question_kind(q) in ("what colour", "what shape")]
    assert [item.question for item in items] == expected and expected
    first = np.asarray(Image.open(held_out[0].image).convert("RGB"))
    assert np.array_equal(items[0].image, first)


def test_an_untrained_copy_has_the_architecture_and_tokenizer_and_fresh_seeded_weights(saved):
    trained = VLFuseModel.from_pretrained(saved[0])
    before = {k: v.clone() for k, v in trained.state_dict().items()}
    state = torch.random.get_rng_state()
    first, again, other = untrained_copy(trained, 1), untrained_copy(trained, 1), untrained_copy(trained, 2)  # the
    # tiny model was itself drawn with seed 0
    assert torch.equal(torch.random.get_rng_state(), state)  # the global random state is left alone
    assert not first.training and first.answers == trained.answers
    assert first.processor.tokenize([QUESTION])["input_ids"].tolist() == trained.processor.tokenize([QUESTION])["input_ids"].tolist()
    fresh, twin, third = first.state_dict(), again.state_dict(), other.state_dict()
    assert {k: v.shape for k, v in fresh.items()} == {k: v.shape for k, v in before.items()}
    assert all(torch.equal(fresh[k], twin[k]) for k in fresh)  # the seed draws the weights
    weights = [k for k in fresh if k.endswith("q_proj.weight")]
    assert weights and not any(torch.equal(fresh[k], before[k]) or torch.equal(fresh[k], third[k]) for k in weights)
    assert all(torch.equal(v, before[k]) for k, v in trained.state_dict().items())  # the trained model is untouched


def test_the_untrained_baseline_scores_every_method_on_an_untrained_model(model):
    pointing = load_script("pointing_game")
    scene = np.full((32, 32, 3), 255, dtype=np.uint8)
    scene[8:24, 8:24] = (200, 30, 30)
    items = [pointing.Item(scene, q) for q in QUESTIONS]
    scores = pointing.score(model, items, seed=3)
    pointing.add_untrained_baseline(scores, model, items, seed=3)
    untrained = {k.removeprefix("untrained model: "): c for k, c in scores.baselines.items() if k.startswith("untrained")}
    assert set(untrained) == set(scores.methods) and all(c[-1] == len(items) for c in untrained.values())
    assert untrained == pointing.score(untrained_copy(model, 3), items, seed=3).methods
    assert "| baseline: untrained model: occlusion |" in pointing.report(scores)


def test_pointing_hits_where_the_maximum_falls_on_the_object():
    pointing = load_script("pointing_game")
    where = np.zeros((8, 8), dtype=bool)
    where[0:2, 4:6] = True  # patch (0, 2) of a 4x4 grid, (0, 1) of a 2x2 one
    region = pointing.patch_region(where, (4, 4))
    assert region.sum() == 1 and region[0, 2]
    assert pointing.patch_region(where, (2, 2)).tolist() == [[False, True], [False, False]]
    peak = np.zeros((4, 4))
    peak[0, 2] = 1.0
    assert pointing.hit(peak, region)
    assert not pointing.hit(peak.T, region)
    assert not pointing.hit(np.zeros((4, 4)), region)  # a flat map points at its first patch


def test_pointing_scores_count_every_question_for_every_method_and_baseline(model):
    pointing = load_script("pointing_game")
    scene = np.full((32, 32, 3), 255, dtype=np.uint8)
    scene[8:24, 8:24] = (200, 30, 30)  # a red square on the centre 2x2 patches of the 4x4 grid, by both rules
    items = [pointing.Item(scene, q) for q in QUESTIONS]
    empty = pointing.Item(np.full((32, 32, 3), 255, dtype=np.uint8), QUESTIONS[0])
    scores = pointing.score(model, items + [empty], seed=0)
    methods, heads, baselines, left_out, refused = (scores.methods, scores.heads, scores.baselines, scores.left_out,
                                                    scores.refused)
    assert left_out == 1 and list(refused) == list(CELL_READER_METHODS)  # nothing to point at; no cell reader
    assert set(methods) == {"attention layer 0", "attention layer 1", "gradcam layer 0", "gradcam layer 1",
                            "rollout", "input_gradient", "occlusion"}
    assert all(total == len(items) and 0 <= touch <= total and strict <= touch
               for touch, strict, total in methods.values())
    assert len(heads) == 4 * HEADS
    assert baselines["uniform map (expected)"][:2] == pytest.approx([len(items) * 4 / 16] * 2)
    assert baselines["centre patch"] == [len(items)] * 3  # patch (2, 2) is the object's
    assert "| baseline: random map |" in pointing.report(scores)


def test_a_patch_touching_the_object_counts_by_the_first_rule_only():
    pointing = load_script("pointing_game")
    scene = np.full((1, 3, 32, 32), 1.0)
    scene[..., 8:16, 8:10] = 0.0  # the object covers 2 of the 8 columns of patch (1, 1): 25%
    scene[..., 8:16, 16:17] = 0.0  # and 1 column of patch (1, 2): 12.5%
    item = pointing.Item(np.zeros((32, 32, 3), dtype=np.uint8), QUESTION)
    touches, strict = (item.region(torch.as_tensor(scene).float(), (4, 4), s) for s in pointing.SHARES.values())
    assert np.argwhere(touches).tolist() == [[1, 1], [1, 2]]
    assert np.argwhere(strict).tolist() == [[1, 1]]


def test_shapes_questions_about_one_object_point_at_its_cell():
    """SHAPES val (never test): the object of ``(is A B)`` is the one cell ``A`` names, lit pixels only."""
    pointing = load_script("pointing_game")
    items = list(pointing.shapes_items(SHARED / "data" / "shapes", 64))
    assert 0 < len(items) < 64 and all(not item.question.startswith("(") for item in items)  # English, as asked
    for item in items:
        rows, cols = np.nonzero(item.cell)
        assert len(rows) == 100 and len(set(rows // 10)) == 1 and len(set(cols // 10)) == 1  # one 10 px cell
        assert item.image[item.cell].max() >= 0.3 * 255  # which holds an object
        region = item.region(None, (3, 3), 0.25)
        assert region.sum() == 1 and region[rows[0] // 10, cols[0] // 10]
        assert item.region(None, (6, 6), 0.25).sum() == 4


def test_a_heads_pointing_score_is_the_share_of_rows_whose_largest_patch_is_an_object():
    """``vlfuse analyze``'s pointing column (vlfuse.analysis.head_stats), by hand on 2 heads, 1 prefix token, 4 cells."""
    from vlfuse.analysis.head_stats import HeadStatsAccumulator, object_pointing

    weights = torch.tensor([
        [[0.6, 0.1, 0.2, 0.05, 0.05], [0.1, 0.1, 0.1, 0.6, 0.1]],  # head 0's largest patch is cell 1 (prefix aside)
        [[0.0, 0.7, 0.1, 0.1, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]],  # a tie points at the first cell
    ])  # (N=2 rows, H=2, 1 + 4 keys)
    objects = torch.tensor([[False, True, False, False], [True, False, False, False]])  # (N, cells)
    by_hand = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    torch.testing.assert_close(object_pointing(weights, objects, 1), by_hand)
    accumulator = HeadStatsAccumulator(2, (2, 2), 1)
    accumulator.update(weights, objects)
    torch.testing.assert_close(accumulator.result().pointing, torch.tensor([1.0, 0.5]))
    accumulator = HeadStatsAccumulator(2, (2, 2), 1)
    accumulator.update(weights)
    assert accumulator.result().pointing.isnan().all()  # no object masks, no score


def tiny_caption_model():
    from vlfuse.captioning import CaptionConfig, CaptionModel
    from vlfuse.encoders import ImageEncoderConfig

    torch.manual_seed(0)
    config = CaptionConfig(image=ImageEncoderConfig(image_size=30, patch_size=10, width=32, depth=1, num_heads=2),
                           dim=32, depth=2, heads=16, dropout=0.0, max_length=6)
    return CaptionModel.from_config(config, ["a red square .", "there is a blue circle ."]).eval()


@pytest.mark.parametrize("method", ["attention", "gradcam", "input_gradient", "occlusion"])
def test_a_caption_gets_a_map_per_generated_word(method):
    from vlfuse.analysis.explain_caption import explain_caption

    model = tiny_caption_model()
    pixels = torch.rand(1, 3, 30, 30, generator=torch.Generator().manual_seed(0))
    e = explain_caption(model, pixels, method)
    heads = 16 if method in ("attention", "gradcam") else 1
    assert e.token_maps.shape == (heads, len(e.words), 1 + 9) and len(e.words) >= 1
    assert e.caption_map.sum() == pytest.approx(1.0, abs=1e-5) and (e.token_maps >= 0).all()
    if method == "attention":
        np.testing.assert_allclose(e.token_maps.sum(-1), 1.0, atol=1e-5)


def test_a_caption_words_gradcam_is_attention_times_its_logits_positive_gradient(monkeypatch):
    """Word t's map: sum over the positions up to t of A * relu(dy_t/dA), against the gradient at the
    weights the block used (float64: exact)."""
    from vlfuse.analysis.explain_caption import explain_caption
    from vlfuse.captioning import greedy

    model = tiny_caption_model().double()
    pixels = torch.rand(1, 3, 30, 30, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    e = explain_caption(model, pixels, "gradcam", layer=0)
    [caption] = greedy(model, model.encode_images(pixels))
    used = []

    def keep_weights(*args, original=attention_module.attention_core, **kwargs):
        out, weights = original(*args, **kwargs)
        if weights is not None and weights.shape[-1] == 10:  # the cross-attention, over 1 + 9 image tokens
            weights.retain_grad()
            used.append(weights)
        return out, weights

    monkeypatch.setattr(attention_module, "attention_core", keep_weights)
    ids = torch.tensor([caption.ids])
    inputs = torch.cat([torch.full((1, 1), model.bos_id), ids[:, :-1]], dim=1)
    logits = model.decode(inputs, model.encode_images(pixels), weights_from=[0]).logits[0]
    t = len(caption.ids) - 1
    logits[t, caption.ids[t]].backward()
    weights = used[0]  # (1, H, T, Li): block 0
    by_hand = (weights.detach() * weights.grad.clamp_min(0))[0, :, : t + 1].sum(1)  # (H, Li)
    assert t >= 1 and float(by_hand.max()) > 0
    np.testing.assert_allclose(e.token_maps[:, t], by_hand.float().numpy(), atol=1e-9 * float(by_hand.abs().max()))


def test_rollout_does_not_explain_captions():
    from vlfuse.analysis.explain_caption import explain_caption

    with pytest.raises(ValueError, match="method 'rollout' does not explain captions .*causal self-attention"):
        explain_caption(tiny_caption_model(), torch.rand(1, 3, 30, 30), "rollout")


def test_a_caption_words_occlusion_is_how_much_painting_each_patch_changes_its_log_odds_where_written():
    from vlfuse.analysis.explain_caption import explain_caption

    model = tiny_caption_model()
    pixels = torch.rand(1, 3, 30, 30, generator=torch.Generator().manual_seed(0))
    e = explain_caption(model, pixels, "occlusion")
    ids = torch.tensor(model.tokenizer.convert_tokens_to_ids(e.words))  # (T,)
    inputs = torch.cat([ids.new_tensor([model.bos_id]), ids[:-1]])[None]  # (1, T): what wrote each word
    with torch.no_grad():
        def odds(images):  # (n, T): log(p / (1 - p)) of each written word, from the probabilities
            p = model(images, inputs.expand(len(images), -1)).double().softmax(-1).gather(-1, ids.expand(len(images), -1)[..., None])[..., 0]
            return (p / (1 - p)).log()

        changes = (odds(occluded_images(pixels[0], (3, 3))) - odds(pixels)).abs()  # (9, T)
    assert e.layer is None and e.heads == ["occlusion (heads mixed)"]
    assert e.token_maps[0, :, 0].sum() == 0  # the prefix token has no pixels
    np.testing.assert_allclose(e.token_maps[0, :, 1:], changes.T.numpy(), rtol=1e-3, atol=1e-4)


def test_the_command_explains_each_word_of_a_caption_model(tmp_path, capsys):
    model_dir = tiny_caption_model().save_pretrained(tmp_path / "captions")
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 30, 3), dtype=np.uint8)).save(tmp_path / "scene.png")
    out = tmp_path / "maps"
    argv = ["explain", "--model", str(model_dir), "--image", str(tmp_path / "scene.png"), "--output", str(out)]
    assert vlfuse_main(argv) == 0
    printed = capsys.readouterr()
    assert printed.out.startswith("caption: ")
    names = [f"scene_{m}_{kind}.png" for m in ("attention", "gradcam", "input_gradient", "occlusion") for kind in ("caption", "words")]
    for name in names + ["scene.npz", "scene.json"]:
        assert (out / name).is_file() and str(out / name) in printed.err, name
    sidecar = json.loads((out / "scene.json").read_text())
    with np.load(out / "scene.npz") as maps:
        assert maps["gradcam_tokens"].shape == (16, len(sidecar["tokens"]), 10)
    with pytest.raises(SystemExit) as usage:
        vlfuse_main([*argv, "--question", "what is it?"])
    assert usage.value.code == 2 and "is a caption model: it explains its own caption" in capsys.readouterr().err


def test_pointing_scores_a_shapes_cell_reader_by_the_methods_it_takes_and_says_why_not_gradcam():
    pointing = load_script("pointing_game")
    config = reader_config("cell_moves")
    config.image.image_size, config.image.patch_size = 30, 10  # a 3x3 grid, one patch per SHAPES cell
    items = list(pointing.shapes_items(SHARED / "data" / "shapes", 32))
    model = VLFuseModel.from_config(config, ["false", "true"], [item.question for item in items]).eval()
    scores = pointing.score(model, items, seed=0)
    methods, heads, left_out, refused = scores.methods, scores.heads, scores.left_out, scores.refused
    with_words = ["attention layer 0", "rollout", "find_gradient", "reader_set", "word_set"]
    assert set(methods) == {"input_gradient", "occlusion", *with_words, *(f"{m}, the named word's map" for m in with_words)}
    assert list(refused) == ["gradcam"] and "fuser 'cell_moves' does not keep them" in refused["gradcam"]
    assert all(total == len(items) - left_out for *_, total in methods.values())
    assert len(heads) == 32 and sum(key.startswith("find_gradient find head") for key in heads) == 16
    # each method's questions split by the model's answer, and the split adds up
    for method, counts in methods.items():
        parts = [c for key, c in scores.by_answer.items() if key.rsplit(" -> ", 1)[0] == method]
        assert parts and all(key.rsplit(" -> ", 1)[1] in ("false", "true") for key in scores.by_answer)
        assert [sum(column) for column in zip(*parts)] == counts
    # the named word's maps split by the word, and the split adds up
    for method in with_words:
        parts = [c for key, c in scores.by_word.items() if key.startswith(f"{method}, the named word's map: ")]
        assert [sum(column) for column in zip(*parts)] == methods[f"{method}, the named word's map"]
    assert {key.rsplit(": ", 1)[1] for key in scores.by_word} <= {"red", "green", "blue", "circle", "square", "triangle"}
    table = pointing.report(scores, by_answer=True)
    assert "| method -> the model's answer |" in table and "| reader_set -> " in table
    assert "| word_set, the named word's map: " in table


def shapes_reader(fuser: str = "cell_moves") -> VLFuseModel:
    torch.manual_seed(0)
    config = reader_config(fuser)
    config.image.image_size, config.image.patch_size = 30, 10  # a 3x3 grid, one patch per SHAPES cell
    return VLFuseModel.from_config(config, ["false", "true"], ["is a red shape above a circle"]).eval()


def test_a_method_asked_for_by_name_that_cannot_explain_the_model_says_why_and_which_fuser(model, saved, tmp_path, capsys):
    image = Image.open(saved[1])
    with pytest.raises(MethodRefused, match="reads a cell reader .* fuser 'fusion_stack' is not one"):
        explain(model, image, QUESTION, "find_gradient")
    argv = ["explain", "--model", str(saved[0]), "--image", str(saved[1]), "--question", QUESTION,
            "--method", "gradcam", "find_gradient", "--output", str(tmp_path / "maps")]
    assert vlfuse_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "method 'find_gradient' reads a cell reader" in err
    assert not (tmp_path / "maps").exists()  # nothing written, not even gradcam's maps


@pytest.mark.parametrize("fuser", ["cell_steps", "cell_moves"])
def test_find_gradient_is_each_finds_score_times_the_positive_slope_of_the_answers_log_probability(fuser):
    model = shapes_reader(fuser)
    scene = np.random.default_rng(1).integers(0, 256, (30, 30, 3), dtype=np.uint8)
    question = "is a red shape above a circle"
    pixels = model.processor.image(scene)[None]
    tokens = model.processor.tokenize([question])
    mask = tokens["attention_mask"].bool()
    with torch.no_grad():
        patches = model.encode_images(pixels).features  # (1, 9, d)
        text = model.encode_questions(tokens["input_ids"], mask.long())
        scores = model.fuser.finds(text, patches)  # (1, T, 9, H)
        evidence = model.fuser.read_finds(text, mask, patches, scores)
        # read_finds with the reader's own finds is the reader
        torch.testing.assert_close(evidence, model.fuser(text, mask, patches).output)
    for answer in ("false", "true"):  # "false" too: its logit is the constant 0, its log-probability is not
        e = explain(model, Image.fromarray(scene), question, "find_gradient", answer=answer)
        chosen = model.answers.index(answer)
        assert e.token_maps.shape == (16, mask.sum(), 9) and e.heads[3] == "find head 3"
        assert e.layer is None and e.question_map.sum() == pytest.approx(1.0, abs=1e-5)
        # the slope by finite differences, at the entry with the largest share
        t, cell, h = np.unravel_index(np.argmax(e.token_maps.transpose(1, 2, 0)), (int(mask.sum()), 9, 16))
        step = 1e-3

        def log_p(delta: float) -> float:
            moved = scores.clone()
            moved[0, t, cell, h] += delta
            with torch.no_grad():
                logits = model.read_out(model.fuser.read_finds(text, mask, patches, moved), mask)[0].double()
            return float(logits.log_softmax(-1)[chosen])

        slope = (log_p(step) - log_p(-step)) / (2 * step)
        share = float(scores[0, t, cell, h]) * slope
        assert share > 0 and e.token_maps[h, t, cell] == pytest.approx(share, rel=2e-2)
        assert (e.token_maps >= 0).all() and e.token_maps.max() > 0


def test_reader_set_is_the_set_the_reader_holds_after_each_word_and_after_the_question():
    model = shapes_reader()
    scene = np.random.default_rng(2).integers(0, 256, (30, 30, 3), dtype=np.uint8)
    question = "is a red shape above a circle"
    e = explain(model, Image.fromarray(scene), question, "reader_set")
    pixels = model.processor.image(scene)[None]
    tokens = model.processor.tokenize([question])
    mask = tokens["attention_mask"].bool()
    with torch.no_grad():
        text = model.encode_questions(tokens["input_ids"], mask.long())
        states = model.fuser.states(text, mask, model.encode_images(pixels).features)[0]  # (Lt, 9)
        evidence = model.fuser(text, mask, model.encode_images(pixels).features).output[0]
    assert e.token_maps.shape == (1, mask.sum(), 9) and e.heads == ["reader_set (heads mixed)"]
    np.testing.assert_allclose(e.token_maps[0], states[mask[0]].numpy(), atol=1e-6)
    np.testing.assert_allclose(e.question_map, (states[0] / states[0].sum()).numpy(), atol=1e-6)
    # the final set is what the answer is read from: its logsumexp of log m is the evidence
    assert float(torch.logsumexp(states[0].log(), 0)) == pytest.approx(float(evidence), abs=1e-5)


def test_word_set_reads_each_word_alone_from_the_whole_grid():
    model = shapes_reader("cell_moves")
    scene = np.random.default_rng(3).integers(0, 256, (30, 30, 3), dtype=np.uint8)
    question = "is a red shape above a circle"
    e = explain(model, Image.fromarray(scene), question, "word_set")
    sets = explain(model, Image.fromarray(scene), question, "reader_set")
    assert e.token_maps.shape == (1, len(e.tokens), 9) and e.heads == ["word_set (heads mixed)"]
    assert ((e.token_maps > 0) & (e.token_maps < 1)).all()
    # the reader reads the last token first, from the whole grid: there reading alone is reading the question
    np.testing.assert_allclose(e.token_maps[0, -1], sets.token_maps[0, -1], atol=1e-6)
    assert not np.allclose(e.token_maps[0, 0], sets.token_maps[0, 0], atol=1e-3)  # "[CLS]", read last, is not
    mean = e.token_maps[0].mean(0)
    np.testing.assert_allclose(e.question_map, mean / mean.sum(), atol=1e-6)
    assert (e.answer, e.probability) == (sets.answer, pytest.approx(sets.probability))  # the whole question's answer


def test_the_named_word_is_the_first_token_that_is_it_and_a_missing_one_names_the_question():
    pointing = load_script("pointing_game")
    scene = np.zeros((30, 30, 3), dtype=np.uint8)
    question = "is a green shape right of right of a green shape"
    item = pointing.CellItem(scene, question, np.zeros((30, 30), dtype=bool), "green")
    tokens = ["[CLS]", *question.split(), "[SEP]"]
    explanation = SimpleNamespace(tokens=tokens)  # named_token reads only the tokens
    assert pointing.named_token(explanation, item) == 3
    explanation.tokens = ["[CLS]", "is", "a", "[UNK]", "shape", "[SEP]"]
    with pytest.raises(ValueError, match="'is a green shape right of .*without 'green'"):
        pointing.named_token(explanation, item)
    assert pointing.Item(scene, question).named_word is None
