"""Predictor and ``vlfuse predict``: answers equal the model's own, images encoded once, bad input reported."""

import json
import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlfuse.analysis import draw_attention_map, split_prefix
from vlfuse.analysis.attention_maps import MAX_OPACITY, attention_figure, heat_overlay
from vlfuse.cli import main as vlfuse_main
from vlfuse.data import preprocess_image
from vlfuse.encoders import ImageEncoder
from vlfuse.layers import attention as attention_module
from vlfuse.model import VLFuseModel
from vlfuse.processor import VLFuseProcessor
from vlfuse.inference import Predictor, PredictWarning

from conftest import load_script, reader_config, tiny_config

ANSWERS = ["no", "yes", "red", "blue", "green", "circle"]
QUESTIONS = ["what color is the shape?", "is there a red shape?", "is there a blue shape?", "what shape is it?"]
HEADS, PREFIX, GRID = 16, 1, (4, 4)  # tiny_config: 16 fusion heads, a CLS token, 32 px / 8 px patches


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    torch.manual_seed(0)
    # Ungated, so that the image changes the answer even without training.
    model = VLFuseModel.from_config(tiny_config(fuser={"gated": False}), ANSWERS, QUESTIONS)
    return model.save_pretrained(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def predictor(model_dir):
    return Predictor.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Three random RGB PNGs of odd sizes."""
    folder = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    paths = []
    for i, size in enumerate([(40, 30), (32, 32), (17, 60)]):
        path = folder / f"{i}.png"
        Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8)).save(path)
        paths.append(path)
    return paths


@pytest.fixture
def encoded(monkeypatch):
    """Records the pixel batch of every image-encoder call."""
    calls = []
    original = ImageEncoder.forward

    def recording(self, pixels, *keys):
        calls.append(pixels.clone())
        return original(self, pixels, *keys)

    monkeypatch.setattr(ImageEncoder, "forward", recording)
    return calls


def reference(model, sources, questions):
    """The model's own forward pass, one image row per question: probabilities (Bq, answers)."""
    pixels = torch.stack([preprocess_image(s, model.config.image.image_size) for s in sources])
    with torch.no_grad():
        return model(pixels, **model.processor.tokenize(questions)).logits.softmax(-1)


def assert_matches(results, probs):
    assert [r["answer"] for r in results] == [ANSWERS[i] for i in probs.argmax(-1)]
    torch.testing.assert_close(torch.tensor([r["score"] for r in results]), probs.max(-1).values, atol=1e-5, rtol=0)


# ----------------------------------------------------------------------------------- answers
def test_batch_prediction_matches_the_models_forward_pass(predictor, images):
    sources = [images[0], images[1], images[0], images[2], images[1]]
    questions = QUESTIONS + QUESTIONS[:1]
    results = predictor.predict(sources, questions)
    probs = reference(predictor.model, sources, questions)
    assert_matches(results, probs)
    # Not vacuous: the same question about different images gets different scores.
    assert abs(results[0]["score"] - results[4]["score"]) > 1e-4
    assert all(set(r) == {"answer", "score"} for r in results)


def test_single_prediction_matches_the_models_forward_pass(predictor, images):
    [result] = predictor.predict([str(images[2])], [QUESTIONS[3]])
    assert_matches([result], reference(predictor.model, [images[2]], [QUESTIONS[3]]))


def test_batch_size_does_not_change_the_answers(predictor, images):
    sources, questions = [images[i % 3] for i in range(7)], [QUESTIONS[i % 4] for i in range(7)]
    one = Predictor(predictor.model, batch_size=1).predict(sources, questions)
    many = predictor.predict(sources, questions)
    assert [r["answer"] for r in one] == [r["answer"] for r in many]
    torch.testing.assert_close([r["score"] for r in one], [r["score"] for r in many], atol=1e-5, rtol=0)


def test_top_k_lists_the_best_answers_in_order(predictor, images):
    [result] = predictor.predict([images[0]], [QUESTIONS[0]], top_k=3)
    probs = reference(predictor.model, [images[0]], [QUESTIONS[0]])[0]
    best = probs.topk(3)
    assert [e["answer"] for e in result["top_k"]] == [ANSWERS[i] for i in best.indices]
    torch.testing.assert_close(torch.tensor([e["score"] for e in result["top_k"]]), best.values, atol=1e-5, rtol=0)
    assert result["top_k"][0] == {"answer": result["answer"], "score": result["score"]}
    with pytest.raises(ValueError, match=r"top_k must be in \[1, 6\]"):
        predictor.predict([images[0]], [QUESTIONS[0]], top_k=7)


def test_misused_arguments_are_refused(predictor, images):
    with pytest.raises(ValueError, match="must be sequences"):
        predictor.predict(str(images[0]), "what?")
    with pytest.raises(ValueError, match="errors must be one of"):
        predictor.predict(images[:1], QUESTIONS[:1], errors="ignore")
    with pytest.raises(ValueError, match="need attention_maps"):
        predictor.predict(images[:1], QUESTIONS[:1], attention_token=0)
    with pytest.raises(ValueError, match=r"attention layers \[2\] out of range: the model has fusion layers 0..1"):
        predictor.predict(images[:1], QUESTIONS[:1], attention_maps="unused", attention_layers=[2])
    assert predictor.predict([], []) == []


def test_mismatched_lengths_name_only_what_was_passed(predictor, images):
    with pytest.raises(ValueError) as error:
        predictor.predict(images[:2], QUESTIONS[:1])
    assert str(error.value) == "need one image per question: got 2 images and 1 questions"
    with pytest.raises(ValueError) as error:
        predictor.predict(images[:2], QUESTIONS[:2], names=["a"])
    assert str(error.value) == "need one image and one name per question: got 2 images, 2 questions and 1 names"


def test_predict_runs_with_its_thread_count_and_restores_the_callers(model_dir, images, monkeypatch):
    seen = []
    original = VLFuseModel.encode_images

    def recording(self, pixels, *keys):
        seen.append(torch.get_num_threads())
        return original(self, pixels, *keys)

    monkeypatch.setattr(VLFuseModel, "encode_images", recording)
    before = torch.get_num_threads()
    for threads in (2, 1):
        Predictor.from_pretrained(model_dir, threads=threads).predict(images[:1], QUESTIONS[:1])
    Predictor.from_pretrained(model_dir, threads=None).predict(images[:1], QUESTIONS[:1])
    assert seen == [2, 1, before]
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="^threads must be at least 1, got 0$"):
        Predictor.from_pretrained(model_dir, threads=0)
    with pytest.raises(ValueError, match="^threads must be a whole number, got 1.5$"):
        Predictor.from_pretrained(model_dir, threads=1.5)


# ------------------------------------------------------------------------------- image cache
@pytest.mark.parametrize("batch_size", [64, 3])
def test_image_cache_encodes_each_image_once_with_the_same_answers(predictor, images, encoded, batch_size):
    # Interleaved, 4 questions per image; with batch_size 3, images span batches.
    sources, questions = [images[i % 3] for i in range(12)], [QUESTIONS[i // 3] for i in range(12)]
    cached = Predictor(predictor.model, batch_size=batch_size).predict(sources, questions)
    assert sum(len(pixels) for pixels in encoded) == 3
    encoded.clear()
    uncached = Predictor(predictor.model, batch_size=batch_size, cache_images=False).predict(sources, questions)
    assert sum(len(pixels) for pixels in encoded) == 12
    assert [r["answer"] for r in cached] == [r["answer"] for r in uncached]
    torch.testing.assert_close([r["score"] for r in cached], [r["score"] for r in uncached], atol=1e-5, rtol=0)
    assert_matches(cached, reference(predictor.model, sources, questions))


def test_the_same_pil_object_is_encoded_once_and_equal_copies_twice(predictor, images, encoded):
    picture = Image.open(images[0])
    copy = picture.copy()
    results = predictor.predict([picture, copy, picture], QUESTIONS[:3])
    assert [len(pixels) for pixels in encoded] == [2]
    assert_matches(results, reference(predictor.model, [images[0]] * 3, QUESTIONS[:3]))


# ------------------------------------------------------------------------------- the processor
def test_processor_loads_each_distinct_image_once_and_the_model_answers_as_the_predictor(predictor, images,
                                                                                       monkeypatch):
    loaded = []
    original = VLFuseProcessor.image

    def recording(self, source):
        loaded.append(source)
        return original(self, source)

    monkeypatch.setattr(VLFuseProcessor, "image", recording)
    model = predictor.model
    # The same file twice (a Path, then its str): one pixel row, both questions about it.
    inputs = model.processor([images[0], str(images[0])], QUESTIONS[:2])
    assert loaded == [images[0]]
    assert inputs.pixel_values.shape == (1, 3, 32, 32)
    assert inputs.image_index.tolist() == [0, 0]
    torch.testing.assert_close(inputs.pixel_values[0], preprocess_image(images[0], 32), atol=0, rtol=0)
    assert set(inputs) == {"pixel_values", "input_ids", "attention_mask", "image_index", "image_keys"}

    loaded.clear()
    sources, questions = [images[0], images[1], images[0], images[2], images[1]], QUESTIONS + QUESTIONS[:1]
    inputs = model.processor(sources, questions)
    assert loaded == [images[0], images[1], images[2]]
    assert inputs.pixel_values.shape[0] == 3 and inputs.image_index.tolist() == [0, 1, 0, 2, 1]
    with torch.no_grad():
        logits = model(**inputs).logits
    # Shared image rows give the logits of one image row per question, and Predictor's answers.
    torch.testing.assert_close(logits.softmax(-1), reference(model, sources, questions), atol=1e-5, rtol=0)
    results = predictor.predict(sources, questions, top_k=len(ANSWERS))
    assert_matches(results, logits.softmax(-1))
    scores = torch.tensor([[next(e["score"] for e in r["top_k"] if e["answer"] == a) for a in ANSWERS] for r in results])
    torch.testing.assert_close(scores, logits.softmax(-1), atol=1e-5, rtol=0)  # every answer's probability


# ------------------------------------------------------------------------------ image formats
def _rgb(rng, size=(45, 70)):
    return Image.fromarray(rng.integers(0, 256, (*size, 3), dtype=np.uint8))


IMAGE_KINDS = {
    "rgb.png": lambda rng: _rgb(rng),
    "rgb.jpg": lambda rng: _rgb(rng, (80, 24)),
    "grayscale.png": lambda rng: _rgb(rng).convert("L"),
    "rgba.png": lambda rng: Image.fromarray(rng.integers(0, 256, (33, 33, 4), dtype=np.uint8), mode="RGBA"),
    "palette.png": lambda rng: _rgb(rng).convert("P", palette=Image.Palette.ADAPTIVE, colors=16),
    "palette.gif": lambda rng: _rgb(rng, (20, 90)).convert("P"),
    "16bit.png": lambda rng: Image.fromarray(rng.integers(0, 65536, (50, 40), dtype=np.uint16)),
    "large.png": lambda rng: _rgb(rng, (300, 200)),
}
OPENED_MODES = {"rgb.png": "RGB", "rgb.jpg": "RGB", "grayscale.png": "L", "rgba.png": "RGBA",
                "palette.png": "P", "palette.gif": "P", "16bit.png": "I;16", "large.png": "RGB"}


@pytest.mark.parametrize("kind", IMAGE_KINDS)
def test_every_image_kind_goes_through_the_training_preprocessing(predictor, tmp_path, encoded, kind):
    path = tmp_path / kind
    IMAGE_KINDS[kind](np.random.default_rng(1)).save(path)
    with Image.open(path) as img:
        assert img.mode == OPENED_MODES[kind]  # the file really is of this kind
    results = predictor.predict([path], [QUESTIONS[0]])
    [pixels] = encoded
    torch.testing.assert_close(pixels[0], preprocess_image(path, 32), atol=0, rtol=0)
    assert_matches(results, reference(predictor.model, [path], [QUESTIONS[0]]))


# -------------------------------------------------------------------------------- bad input
def bad_images(folder: Path) -> dict[str, Path]:
    folder.mkdir(exist_ok=True)
    corrupt = folder / "corrupt.png"
    corrupt.write_bytes(b"this is not an image")
    whole = folder / "whole.png"
    Image.fromarray(np.random.default_rng(2).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(whole)
    truncated = folder / "truncated.png"
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    return {"missing": folder / "missing.png", "corrupt": corrupt, "truncated": truncated}


def test_report_policy_answers_every_good_pair_in_order(predictor, images, tmp_path):
    bad = bad_images(tmp_path)
    sources = [images[0], bad["missing"], images[1], bad["corrupt"], images[2], bad["truncated"], images[0], 3.5]
    questions = [QUESTIONS[0], QUESTIONS[0], QUESTIONS[1], QUESTIONS[1], "  ", QUESTIONS[2], QUESTIONS[3], QUESTIONS[0]]
    results = predictor.predict(sources, questions, errors="report")
    errors = {i: r["error"] for i, r in enumerate(results) if "error" in r}
    assert sorted(errors) == [1, 3, 4, 5, 7]
    assert "image file not found" in errors[1] and "missing.png" in errors[1]
    assert "cannot read image" in errors[3] and "corrupt.png" in errors[3]
    assert "cannot read image" in errors[5] and "truncated.png" in errors[5]
    assert errors[4] == "empty question"
    assert "image must be a file path" in errors[7]
    assert all("answer" not in results[i] for i in errors)
    good = [0, 2, 6]
    expected = reference(predictor.model, [sources[i] for i in good], [questions[i] for i in good])
    assert_matches([results[i] for i in good], expected)


@pytest.mark.parametrize("case", ["missing", "corrupt", "truncated", "empty question"])
def test_raise_policy_names_the_bad_row(predictor, images, tmp_path, case):
    bad = bad_images(tmp_path)
    sources = [images[0], bad.get(case, images[1])]
    questions = [QUESTIONS[0], "" if case == "empty question" else QUESTIONS[1]]
    with pytest.raises(ValueError, match=f"^row 1: .*{'empty question' if case == 'empty question' else case}"):
        predictor.predict(sources, questions)


def test_too_long_question_is_truncated_with_a_warning(predictor, images):
    long = "what color is the shape " * 6  # 30 words + [CLS] + [SEP] > max_length 16
    with pytest.warns(PredictWarning, match="^row 1: question has 32 tokens; the model reads the first 16$"):
        results = predictor.predict([images[0], images[1]], [QUESTIONS[0], long])
    assert results[1]["warnings"] == ["question has 32 tokens; the model reads the first 16"]
    assert "warnings" not in results[0]
    assert_matches(results, reference(predictor.model, [images[0], images[1]], [QUESTIONS[0], long]))


def test_unknown_words_are_named_in_a_warning(predictor, images):
    question = "Is there a purple zorgon? a zorgon?"
    with pytest.warns(PredictWarning, match=r"^row 0: unknown words, read as \[UNK\]: 'purple', 'zorgon'$"):
        [result] = predictor.predict([images[0]], [question])
    assert result["warnings"] == ["unknown words, read as [UNK]: 'purple', 'zorgon'"]
    ids = predictor.model.processor.tokenize([question])["input_ids"][0]
    assert int((ids == predictor.model.tokenizer.unk_token_id).sum()) == 3  # what the warning says
    assert_matches([result], reference(predictor.model, [images[0]], [question]))  # and it is still answered
    with warnings.catch_warnings():
        warnings.simplefilter("error", PredictWarning)
        predictor.predict([images[0]], ["IS there a RED shape?"])  # known words, any case: no warning


def test_broken_model_directories_raise_clear_errors(model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="not a saved vlfuse model: missing model.safetensors"):
        Predictor.from_pretrained(tmp_path)
    other = shutil.copytree(model_dir, tmp_path / "other")
    meta = json.loads((model_dir / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**meta, "format_version": 99}))
    with pytest.raises(ValueError, match="written by another vlfuse version"):
        Predictor.from_pretrained(other)


# ----------------------------------------------------------------------------- attention maps
def test_attention_maps_files_panels_and_weights(predictor, images, tmp_path, monkeypatch):
    slow_calls = []
    core = attention_module.attention_core

    def spying(*args, **kwargs):
        slow_calls.append(kwargs.get("need_weights", False))
        return core(*args, **kwargs)

    monkeypatch.setattr(attention_module, "attention_core", spying)
    sources, questions = [images[0], images[1]], QUESTIONS[:2]
    results = predictor.predict(sources, questions, attention_maps=tmp_path, attention_layers=[1])
    # One forward pass: self- and cross-attention in 2 layers; only layer 1's cross-attention is slow.
    assert slow_calls.count(True) == 1 and len(slow_calls) == 4
    assert [r["answer"] for r in results] == [r["answer"] for r in predictor.predict(sources, questions)]

    model = predictor.model
    pixels = torch.stack([preprocess_image(s, 32) for s in sources])
    tokens = model.processor.tokenize(questions)
    with torch.no_grad():
        out = model(pixels, **tokens, weights_from=[1])
    for row in range(2):
        assert (tmp_path / f"row_{row}_layer1.png").stat().st_size > 0
        assert not (tmp_path / f"row_{row}_layer0.png").exists()
        sidecar = json.loads((tmp_path / f"row_{row}.json").read_text())
        assert sidecar["layers"]["1"]["panels"] == HEADS + 1  # one per head and the head average
        assert sidecar["layers"]["1"]["heads"] == list(range(HEADS))
        weights = np.load(tmp_path / f"row_{row}.npz")["layer_1"]
        assert weights.shape == (HEADS, PREFIX + GRID[0] * GRID[1])
        # Over every image token (the CLS prefix token included), each head's weights sum to 1.
        np.testing.assert_allclose(weights.sum(-1), np.ones(HEADS), atol=1e-5)
        np.testing.assert_allclose(sidecar["layers"]["1"]["prefix_mass"], weights[:, :PREFIX].sum(-1), atol=1e-6)
        # The pooled question: the mean over real question tokens of the model's own weights.
        real = out.text_mask[row]
        expected = out.attentions[1][row][:, real].mean(1)  # (H, Li)
        np.testing.assert_allclose(weights, expected.numpy(), atol=1e-5)
        assert results[row]["attention_maps"]["weights"] == str(tmp_path / f"row_{row}.npz")


def test_attention_maps_of_the_cell_steps_fuser_cover_its_16_heads_over_the_patches(images, tmp_path):
    torch.manual_seed(0)
    model = VLFuseModel.from_config(reader_config("cell_steps"), ["false", "true"], ["is a red square left of a circle"])
    assert model.fusion_head_ids == [list(range(HEADS))]
    sources, questions = images[:2], ["is a red square left of a circle", "is a circle"]
    results = Predictor(model).predict(sources, questions, attention_maps=tmp_path)
    inputs = model.processor(sources, questions)
    with torch.no_grad():
        out = model(**inputs, weights_from=[0])
    for row in range(2):
        assert (tmp_path / f"row_{row}_layer0.png").stat().st_size > 0
        sidecar = json.loads((tmp_path / f"row_{row}.json").read_text())
        assert sidecar["layers"]["0"]["heads"] == list(range(HEADS))
        weights = np.load(tmp_path / f"row_{row}.npz")["layer_0"]
        real = out.text_mask[row]
        np.testing.assert_allclose(weights, out.attentions[0][row][:, real].mean(1).numpy(), atol=1e-5)
        np.testing.assert_allclose(weights.sum(-1), np.ones(HEADS), atol=1e-5)  # each head's weights: a distribution
        assert results[row]["attention_maps"]["weights"] == str(tmp_path / f"row_{row}.npz")


def test_attention_token_selects_one_position_and_is_checked(predictor, images, tmp_path):
    model = predictor.model
    results = predictor.predict([images[0], images[1]], ["what shape is it?", "is it red?"], errors="report",
                                attention_maps=tmp_path, attention_layers=[0], attention_token=5)
    # With [CLS] and [SEP]: "what shape is it?" has 7 tokens (5 is '?'), "is it red?" 6, "red?" 4.
    assert "error" not in results[0] and "error" not in results[1]
    tokens = model.processor.tokenize(["what shape is it?"])
    with torch.no_grad():
        out = model(preprocess_image(images[0], 32)[None], **tokens, weights_from=[0])
    saved = np.load(tmp_path / "row_0.npz")["layer_0"]
    np.testing.assert_allclose(saved, out.attentions[0][0][:, 5].numpy(), atol=1e-5)
    assert "token 5 '?'" in json.loads((tmp_path / "row_0.json").read_text())["query"]

    results = predictor.predict([images[0], images[1]], ["what shape is it?", "red?"], errors="report",
                                attention_maps=tmp_path, attention_layers=[0], attention_token=5)
    assert results[1] == {"error": "attention_token 5 is not a position of this question (4 tokens)"}
    assert "answer" in results[0]


def test_heat_overlay_leaves_unattended_patches_transparent():
    overlay = heat_overlay(np.array([[0.0, 0.5], [1.0, 2.0]]), vmax=1.0)
    assert overlay.shape == (2, 2, 4)
    assert overlay[0, 0, 3] == 0.0  # no attention: the image shows unchanged
    assert overlay[0, 1, 3] == pytest.approx(MAX_OPACITY / 2)
    assert overlay[1, 0, 3] == overlay[1, 1, 3] == pytest.approx(MAX_OPACITY)  # clipped at vmax


def test_attention_figure_has_a_panel_per_head_and_one_colour_bar():
    weights = torch.rand(3, 1 + 4).softmax(-1)
    figure = attention_figure(np.full((16, 16, 3), 0.5), weights, (2, 2), 1)
    bars = [ax for ax in figure.axes if ax.get_label() == "<colorbar>"]
    assert len(figure.axes) == 3 + 1 + 1 and len(bars) == 1
    assert bars[0].get_ylim()[1] == pytest.approx(float(split_prefix(weights, (2, 2), 1)[0].max()))
    assert "attention to the patch" in bars[0].get_ylabel()


def test_draw_attention_map_labels_pruned_heads(tmp_path):
    weights = torch.rand(14, 1 + 9).softmax(-1)
    kept = [1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]  # heads 0 and 5 pruned
    panels = draw_attention_map(np.zeros((24, 24, 3)), weights, (3, 3), 1, tmp_path / "m.png", head_ids=kept)
    assert panels == 15 and (tmp_path / "m.png").stat().st_size > 0
    maps, prefix = split_prefix(weights, (3, 3), 1)
    assert maps.shape == (14, 3, 3)
    torch.testing.assert_close(maps.sum((1, 2)) + prefix, torch.ones(14))
    with pytest.raises(ValueError, match="cover 10 image tokens, but 1 prefix tokens and a 4x4 grid make 17"):
        split_prefix(weights, (4, 4), 1)


# ------------------------------------------------------------------------------- the command
def test_cli_single_pair_prints_answer_probability_and_top_k(predictor, model_dir, images, capsys):
    [expected] = predictor.predict([images[0]], [QUESTIONS[0]], top_k=3)
    args = ["predict", "--model", str(model_dir), "--image", str(images[0]), "--question", QUESTIONS[0]]
    assert vlfuse_main(args) == 0
    assert capsys.readouterr().out == f"answer: {expected['answer']} (probability {expected['score']:.4f})\n"
    assert vlfuse_main([*args, "--top-k", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == "top 3:"
    assert [line.split() for line in lines[2:]] == [[e["answer"], f"{e['score']:.4f}"] for e in expected["top_k"]]


def test_cli_directory_as_image_and_missing_model_folder_get_their_own_line(model_dir, images, tmp_path, capsys):
    question = ["--question", QUESTIONS[0]]
    assert vlfuse_main(["predict", "--model", str(model_dir), "--image", str(tmp_path), *question]) == 2
    assert capsys.readouterr().err == f"vlfuse: error: {tmp_path} is a directory, not an image file\n"
    missing = tmp_path / "no_such_model"
    assert vlfuse_main(["predict", "--model", str(missing), "--image", str(images[0]), *question]) == 2
    assert capsys.readouterr().err == f"vlfuse: error: model folder not found: {missing}\n"


def test_cli_single_pair_errors_are_one_line(model_dir, tmp_path, capsys):
    missing = str(tmp_path / "x.png")
    assert vlfuse_main(["predict", "--model", str(model_dir), "--image", missing, "--question", "what?"]) == 2
    assert capsys.readouterr().err == f"vlfuse: error: image file not found: {tmp_path / 'x.png'}\n"
    assert vlfuse_main(["predict", "--model", str(tmp_path), "--image", "x.png", "--question", "what?"]) == 2
    assert "vlfuse: error: " in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        vlfuse_main(["predict", "--model", str(model_dir), "--image", "x.png", "--input", "pairs.jsonl"])
    assert exit_info.value.code == 2
    assert "give either --image and --question, or --input (and optionally --output)" in capsys.readouterr().err


def test_cli_batch_reports_bad_rows_and_answers_the_rest_in_order(
    predictor, model_dir, images, tmp_path, encoded, capsys
):
    bad = bad_images(tmp_path / "bad")
    folder = images[0].parent
    lines = [
        json.dumps({"image": images[0].name, "question": QUESTIONS[0]}),  # 1: relative to the JSONL file
        json.dumps({"image": str(images[1]), "question": QUESTIONS[1]}),  # 2: absolute
        '{"image": "0.png", "question": ',  # 3: malformed
        "",  # 4: blank, skipped
        json.dumps({"image": "0.png"}),  # 5: no question
        json.dumps({"image": str(bad["missing"]), "question": QUESTIONS[0]}),  # 6
        json.dumps({"image": "1.png", "question": ""}),  # 7
        json.dumps({"image": "1.png", "question": QUESTIONS[2]}),  # 8: same image as line 2
        "[1, 2]",  # 9: not an object
        json.dumps({"image": str(bad["truncated"]), "question": "what purple thing?"}),  # 10
    ]
    pairs = folder / "pairs.jsonl"
    pairs.write_text("\n".join(lines) + "\n")
    output = tmp_path / "out" / "answers.jsonl"
    args = ["predict", "--model", str(model_dir), "--input", str(pairs), "--output", str(output), "--batch-size", "2"]
    assert vlfuse_main(args) == 1
    assert sum(len(pixels) for pixels in encoded) == 2  # 0.png once, 1.png once (lines 2 and 8)
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 3, 5, 6, 7, 8, 9, 10]
    failed = {r["line"]: r["error"] for r in rows if "error" in r}
    assert sorted(failed) == [3, 5, 6, 7, 9, 10]
    assert failed[3].startswith("line 3: not valid JSON: Expecting")
    assert failed[5] == "line 5: missing 'question'"
    assert failed[6].startswith("line 6: image file not found")
    assert failed[7] == "line 7: empty question"
    assert failed[9] == "line 9: expected a JSON object with 'image' and 'question'"
    assert failed[10].startswith("line 10: cannot read image")
    assert rows[4] == {"line": 6, "image": str(bad["missing"]), "question": QUESTIONS[0], "error": failed[6]}
    expected = predictor.predict([images[0], images[1], images[1]], [QUESTIONS[0], QUESTIONS[1], QUESTIONS[2]])
    answered = [r for r in rows if "answer" in r]
    assert [(r["line"], r["image"], r["question"]) for r in answered] == [
        (1, "0.png", QUESTIONS[0]), (2, str(images[1]), QUESTIONS[1]), (8, "1.png", QUESTIONS[2])]
    assert [r["answer"] for r in answered] == [e["answer"] for e in expected]
    err = capsys.readouterr().err
    assert "vlfuse: warning: line 10: unknown words, read as [UNK]: 'purple', 'thing'" in err
    assert err.splitlines()[-1].startswith("vlfuse predict: 6 of 9 rows failed (lines 3, 5, 6, 7, 9, 10)")


def test_cli_batch_top_k_and_attention_maps(model_dir, images, tmp_path, capsys):
    pairs = tmp_path / "pairs.jsonl"
    lines = [json.dumps({"image": str(path), "question": QUESTIONS[i]}) for i, path in enumerate(images[:2])]
    pairs.write_text("\n".join(lines) + "\n")
    output, maps = tmp_path / "answers.jsonl", tmp_path / "maps"
    args = ["predict", "--model", str(model_dir), "--input", str(pairs), "--output", str(output), "--top-k", "2",
            "--attention-maps", str(maps), "--attention-layers", "0"]
    assert vlfuse_main(args) == 0
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [len(r["top_k"]) for r in rows] == [2, 2]
    assert sorted(p.name for p in maps.iterdir()) == [
        "line_1.json", "line_1.npz", "line_1_layer0.png", "line_2.json", "line_2.npz", "line_2_layer0.png"]
    assert rows[1]["attention_maps"]["png"] == [str(maps / "line_2_layer0.png")]
    assert capsys.readouterr().err == (
        f"vlfuse predict: wrote attention maps to {maps}\nvlfuse predict: answered every row (2); wrote {output}\n"
    )


def test_cli_without_output_writes_jsonl_to_stdout_and_the_summary_to_stderr(predictor, model_dir, images, tmp_path,
                                                                            capsys):
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"image": str(p), "question": QUESTIONS[0]}) + "\n" for p in images[:2]))
    assert vlfuse_main(["predict", "--model", str(model_dir), "--input", str(pairs)]) == 0
    captured = capsys.readouterr()
    rows = [json.loads(line) for line in captured.out.splitlines()]
    expected = predictor.predict(images[:2], [QUESTIONS[0]] * 2)
    assert [(r["line"], r["answer"]) for r in rows] == [(1, expected[0]["answer"]), (2, expected[1]["answer"])]
    assert captured.err == "vlfuse predict: answered every row (2); wrote standard output\n"


def test_cli_single_pair_says_where_the_attention_maps_are(model_dir, images, tmp_path, capsys):
    args = ["predict", "--model", str(model_dir), "--image", str(images[0]), "--question", QUESTIONS[0],
            "--attention-maps", str(tmp_path / "maps"), "--attention-layers", "1"]
    assert vlfuse_main(args) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert last == f"attention maps: {tmp_path / 'maps' / 'row_0_layer1.png'}"
    assert (tmp_path / "maps" / "row_0_layer1.png").stat().st_size > 0


# ------------------------------------------------------------------------------- the benchmark
def test_benchmark_runs_every_case_and_prints_a_table(model_dir, capsys):
    bench = load_script("bench_predict")
    args = ["--model", str(model_dir), "--images", "2", "--questions-per-image", "3", "--batch-sizes", "1", "4",
            "--repeats", "2", "--warmup", "0", "--threads", "1", "2", "--busy", "1"]
    samples = bench.main(args)
    assert set(samples) == {(b, cache, t) for b in (1, 4) for cache in (True, False) for t in (1, 2)}
    assert all(len(times) == 2 for times in samples.values())
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    cases = [[cell.strip() for cell in line.split("|")[1:4]] for line in table]
    assert cases == [[b, cache, t] for b in ("1", "4") for cache in ("on", "off") for t in ("1", "2")]
    assert [line.split("|")[-2].strip() for line in table][::2] == ["1.00x"] * 4  # 1 thread vs itself
    assert "1 busy processes added" in out
    assert "answers identical in every case: yes" in out
