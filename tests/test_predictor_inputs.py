"""What a Predictor takes: images as numpy arrays and torch tensors in any usual layout, and questions of unknown words."""

import json

import numpy as np
import pytest
import torch
from PIL import Image

from vlfuse.cli import main as vlfuse_main
from vlfuse.data import ImageLoadError, preprocess_image
from vlfuse.inference import Predictor, PredictWarning
from vlfuse.model import VLFuseModel

from conftest import tiny_config

ANSWERS = ["no", "yes", "red", "blue", "green", "circle"]
QUESTIONS = ["what color is the shape?", "is there a red shape?", "is there a blue shape?", "what shape is it?"]
SIZE = 32  # tiny_config's image size
LEVEL = 1 / 255

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def predictor(tmp_path_factory):
    torch.manual_seed(0)
    model = VLFuseModel.from_config(tiny_config(fuser={"gated": False}), ANSWERS, QUESTIONS)
    return Predictor.from_pretrained(model.save_pretrained(tmp_path_factory.mktemp("model") / "tiny"))


def pixels(channels: int | None, height: int = 20, width: int = 45, seed: int = 0) -> np.ndarray:
    """Random uint8 pixels ``(H, W)`` (``channels`` None) or ``(H, W, channels)``."""
    shape = (height, width) if channels is None else (height, width, channels)
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


GRAY, RGB, RGBA = pixels(None), pixels(3), pixels(4)
FORMS = {  # name: (the image as a user holds it, the PIL image it stands for)
    "numpy (H, W) uint8": (GRAY, Image.fromarray(GRAY, mode="L")),
    "numpy (H, W, 1) uint8": (GRAY[:, :, None], Image.fromarray(GRAY, mode="L")),
    "numpy (H, W, 3) uint8": (RGB, Image.fromarray(RGB)),
    "numpy (H, W, 4) uint8": (RGBA, Image.fromarray(RGBA, mode="RGBA")),
    "numpy (3, H, W) uint8": (RGB.transpose(2, 0, 1), Image.fromarray(RGB)),
    "numpy (1, H, W) uint8": (GRAY[None], Image.fromarray(GRAY, mode="L")),
    "numpy (H, W, 3) float64": (RGB / 255.0, Image.fromarray(RGB)),
    "numpy (H, W) float32": ((GRAY / 255.0).astype(np.float32), Image.fromarray(GRAY, mode="L")),
    "numpy (H, W) bool": (GRAY > 127, Image.fromarray(np.where(GRAY > 127, 255, 0).astype(np.uint8), mode="L")),
    "torch (3, H, W) uint8": (torch.from_numpy(RGB).permute(2, 0, 1), Image.fromarray(RGB)),
    "torch (3, H, W) float32": (torch.from_numpy(RGB).permute(2, 0, 1) / 255.0, Image.fromarray(RGB)),
    "torch (3, H, W) float16": ((torch.from_numpy(RGB).permute(2, 0, 1) / 255.0).half(), Image.fromarray(RGB)),
    "torch (4, H, W) uint8": (torch.from_numpy(RGBA).permute(2, 0, 1), Image.fromarray(RGBA, mode="RGBA")),
    "torch (1, H, W) float32": (torch.from_numpy(GRAY)[None] / 255.0, Image.fromarray(GRAY, mode="L")),
    "torch (H, W) uint8": (torch.from_numpy(GRAY), Image.fromarray(GRAY, mode="L")),
    "torch (H, W, 3) uint8": (torch.from_numpy(RGB), Image.fromarray(RGB)),  # (20, 45, 3): only the last is 3
}


@pytest.mark.parametrize("form", list(FORMS))
def test_every_array_form_gives_the_pil_images_pixels(form):
    array, image = FORMS[form]
    expected = preprocess_image(image, SIZE)
    torch.testing.assert_close(preprocess_image(array, SIZE), expected, rtol=0, atol=LEVEL)


def test_non_contiguous_and_gpu_style_tensors_are_read():
    tensor = torch.from_numpy(RGB).permute(2, 0, 1).float().div(255).requires_grad_()  # (3, H, W), needs grad
    torch.testing.assert_close(preprocess_image(tensor, SIZE), preprocess_image(Image.fromarray(RGB), SIZE), rtol=0, atol=LEVEL)
    flipped = RGB[::-1, ::2]  # negative and doubled strides
    torch.testing.assert_close(preprocess_image(flipped, SIZE), preprocess_image(Image.fromarray(flipped.copy()), SIZE), rtol=0, atol=0)


def test_the_layout_rule_numpy_prefers_channel_last_torch_channel_first():
    both = pixels(3, height=4, width=10)  # (4, 10, 3): 4 and 3 are both channel counts
    chw = both.transpose(2, 0, 1).copy()  # (3, 4, 10): a numpy array of this shape is channel-first
    assert preprocess_image(both, SIZE).equal(preprocess_image(Image.fromarray(both), SIZE))
    assert preprocess_image(chw, SIZE).equal(preprocess_image(Image.fromarray(both), SIZE))
    as_chw = torch.from_numpy(both)  # the same (4, 10, 3) as a tensor: 4 channels (RGBA), 10 x 3 pixels
    rgba = both.transpose(1, 2, 0).copy()  # (10, 3, 4)
    assert preprocess_image(as_chw, SIZE).equal(preprocess_image(Image.fromarray(rgba, mode="RGBA"), SIZE))


BAD = {
    "4-D": (np.zeros((2, 3, 8, 8), dtype=np.uint8), r"image array of shape \(2, 3, 8, 8\) and dtype uint8: expected"),
    "2 channels": (np.zeros((8, 8, 2), dtype=np.uint8), r"image array of shape \(8, 8, 2\) and dtype uint8: expected"),
    "7 channels": (torch.zeros(7, 8, 9), r"image tensor of shape \(7, 8, 9\) and dtype float32: expected"),
    "NaN": (np.full((8, 8), np.nan, dtype=np.float32), r"shape \(8, 8\) and dtype float32: has NaN or infinite values"),
    "0-255 floats": (RGB.astype(np.float32), r"float pixels must be in \[0, 1\], found values in \[0, 255\]"),
    "negative": (torch.full((3, 4, 4), -0.5), r"tensor of shape \(3, 4, 4\) .*found values in \[-0.5, -0.5\]"),
    "int64": (np.zeros((8, 8, 3), dtype=np.int64), r"dtype int64: pixels must be uint8 \(0-255\), float in \[0, 1\] or bool"),
    "empty": (np.zeros((0, 8, 3), dtype=np.uint8), r"shape \(0, 8, 3\) .*: the image has no pixels"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_array_is_a_one_line_error_naming_its_shape_and_dtype(case):
    array, message = BAD[case]
    with pytest.raises(ImageLoadError, match=message) as caught:
        preprocess_image(array, SIZE)
    assert "\n" not in str(caught.value)


def test_predictor_answers_arrays_as_their_pil_images_and_reports_bad_ones(predictor):
    tensor, image = FORMS["torch (3, H, W) float32"]
    gray, gray_image = FORMS["numpy (H, W) uint8"]
    questions = [QUESTIONS[0], QUESTIONS[1], QUESTIONS[0], QUESTIONS[2]]
    results = predictor.predict([tensor, tensor, gray, BAD["NaN"][0]], questions, errors="report")
    expected = predictor.predict([image, image, gray_image], questions[:3])
    for result, reference in zip(results, expected):
        assert result["answer"] == reference["answer"] and result["score"] == pytest.approx(reference["score"], abs=1e-5)
    assert results[3] == {"error": "image array of shape (8, 8) and dtype float32: has NaN or infinite values"}
    with pytest.raises(ImageLoadError, match=r"^row 1: image tensor of shape \(7, 8, 9\)"):
        predictor.predict([tensor, BAD["7 channels"][0]], QUESTIONS[:2])


def test_the_rows_of_a_batch_tensor_are_different_images(predictor):
    batch = torch.stack([FORMS["torch (3, H, W) float32"][0], torch.zeros(3, 20, 45)])  # (2, 3, H, W)
    inputs = predictor.model.processor(batch, QUESTIONS[:2])  # the rows are new objects: each is kept alive
    assert inputs.image_index.tolist() == [0, 1]
    assert not inputs.pixel_values[1].any() and inputs.pixel_values[0].any()
    results = predictor.predict(batch, QUESTIONS[:2])
    assert [r["answer"] for r in results] == [r["answer"] for r in predictor.predict(list(batch), QUESTIONS[:2])]


UNKNOWN = {  # question: (unknown words, low confidence)
    "what color is the shape?": ([], False),
    "what color is the blob?": (["blob"], False),  # 1 of 5 words
    "what blob?": (["blob"], True),  # 1 of 2: exactly half
    "which hue does the blob have?": (["which", "hue", "does", "blob", "have"], True),  # 5 of 6
    "Which BLOB, which blob?": (["Which", "BLOB", ",", "which", "blob"], True),  # as written, once each; 4 of 4 words
}


def test_unknown_words_and_low_confidence_are_in_the_result(predictor):
    images = [FORMS["numpy (H, W, 3) uint8"][0]] * len(UNKNOWN)
    with pytest.warns(PredictWarning) as caught:
        results = predictor.predict(images, list(UNKNOWN))
    for result, (words, low) in zip(results, UNKNOWN.values()):
        assert "answer" in result
        assert result.get("unknown_words", []) == words
        assert result.get("low_confidence", False) is low
    assert results[0].keys() == {"answer", "score"}
    assert results[3]["warnings"] == [
        "unknown words, read as [UNK]: 'which', 'hue', 'does', 'blob', 'have'",
        "5 of the question's 6 words are unknown: a low-confidence answer",
    ]
    assert "row 2: 1 of the question's 2 words are unknown: a low-confidence answer" in [str(w.message) for w in caught]


def test_an_error_row_keeps_its_unknown_words_without_a_confidence(predictor):
    with pytest.warns(PredictWarning) as caught:
        [result] = predictor.predict([BAD["4-D"][0]], ["what blob?"], errors="report")
    assert len(caught) == 2  # the question's warnings are issued before its image is read
    assert result["unknown_words"] == ["blob"] and "low_confidence" not in result and "error" in result


def test_vlfuse_predict_jsonl_carries_the_fields(predictor, tmp_path, capsys):
    image = tmp_path / "image.png"
    Image.fromarray(RGB).save(image)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"image": image.name, "question": q}) + "\n" for q in UNKNOWN))
    output = tmp_path / "answers.jsonl"
    model_dir = predictor.model.save_pretrained(tmp_path / "model")
    assert vlfuse_main(["predict", "--model", str(model_dir), "--input", str(pairs), "--output", str(output)]) == 0
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    for row, (words, low) in zip(rows, UNKNOWN.values()):
        assert row.get("unknown_words", []) == words and row.get("low_confidence", False) is low
    assert "vlfuse: warning: line 4: 5 of the question's 6 words are unknown: a low-confidence answer" in capsys.readouterr().err
