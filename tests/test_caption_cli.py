"""``vlfuse caption``, :class:`vlfuse.Captioner` and a short ``vlfuse fit`` of a caption config."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from test_caption_model import tiny_caption_model
from vlfuse.captioning import CaptionModel, greedy
from vlfuse.cli import main as vlfuse_main
from vlfuse.data import preprocess_image
from vlfuse.inference import Captioner, Predictor
from vlfuse.model import VLFuseModel

from conftest import COLOUR_ANSWERS, REPO, tiny_caption_overrides, tiny_config


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_caption_model(seed=2).save_pretrained(tmp_path_factory.mktemp("caption") / "model")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scenes")
    rng = np.random.default_rng(0)
    paths = []
    for i in range(3):
        paths.append(folder / f"{i}.png")
        Image.fromarray(rng.integers(0, 256, (30, 30, 3), dtype=np.uint8)).save(paths[-1])
    return paths


def expected_captions(model_dir, images, **options):
    model = CaptionModel.from_pretrained(model_dir)
    pixels = torch.stack([preprocess_image(path, 30) for path in images])
    return [c.text for c in greedy(model, model.encode_images(pixels), **options)]


def test_captioner_captions_as_the_model_does_and_reports_bad_images_in_place(model_dir, images, tmp_path):
    captioner = Captioner.from_pretrained(model_dir, batch_size=2)
    results = captioner.caption([images[0], tmp_path / "missing.png", images[1], images[2]], errors="report", max_length=8)
    assert [r.get("caption") for r in results] == [*expected_captions(model_dir, images[:1], max_length=8), None,
                                                   *expected_captions(model_dir, images[1:], max_length=8)]
    assert results[1]["error"].startswith("image file not found")
    with pytest.raises(ValueError, match=r"row 1: image file not found"):
        captioner.caption([images[0], tmp_path / "missing.png"])


def test_predictor_refuses_a_caption_model_in_one_line_naming_the_captioner(model_dir, images, capsys):
    with pytest.raises(ValueError) as error:
        Predictor.from_pretrained(model_dir)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{model_dir} is a caption model") and "vlfuse.Captioner" in message
    args = ["predict", "--model", str(model_dir), "--image", str(images[0]), "--question", "what shape is it?"]
    assert vlfuse_main(args) == 2
    assert capsys.readouterr().err == f"vlfuse: error: {message}\n"


def test_captioner_refuses_an_answering_model_in_one_line_naming_the_predictor(images, tmp_path, capsys):
    torch.manual_seed(0)
    answering = VLFuseModel.from_config(tiny_config(), COLOUR_ANSWERS, ["what color is the shape?"])
    directory = answering.save_pretrained(tmp_path / "answering")
    with pytest.raises(ValueError) as error:
        Captioner.from_pretrained(directory)
    message = str(error.value)
    assert "\n" not in message
    assert message.startswith(f"{directory} is a model that answers questions") and "vlfuse.Predictor" in message
    assert vlfuse_main(["caption", "--model", str(directory), "--image", str(images[0])]) == 2
    assert capsys.readouterr().err == f"vlfuse: error: {message}\n"


def test_captioner_checks_the_attention_layers(model_dir, images):
    captioner = Captioner.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"attention layers \[2\] out of range"):
        captioner.caption([images[0]], attention_maps="maps", attention_layers=[2])


def test_cli_single_image_prints_the_caption(model_dir, images, capsys):
    assert vlfuse_main(["caption", "--model", str(model_dir), "--image", str(images[0]), "--max-length", "6"]) == 0
    assert capsys.readouterr().out == expected_captions(model_dir, images[:1], max_length=6)[0] + "\n"


def test_cli_batch_reports_bad_rows_in_place(model_dir, images, tmp_path, capsys):
    lines = [
        json.dumps({"image": str(images[0])}),  # 1
        "{not json",  # 2
        json.dumps({"picture": "0.png"}),  # 3
        json.dumps({"image": str(tmp_path / "missing.png")}),  # 4
        json.dumps(["0.png"]),  # 5
        json.dumps({"image": images[1].name}),  # 6: relative to the file
    ]
    source = images[0].parent / "images.jsonl"
    source.write_text("\n".join(lines) + "\n")
    output = tmp_path / "captions.jsonl"
    args = ["caption", "--model", str(model_dir), "--input", str(source), "--output", str(output), "--max-length", "6"]
    assert vlfuse_main(args) == 1
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5, 6]
    failed = {r["line"]: r["error"] for r in rows if "error" in r}
    assert failed[2].startswith("line 2: not valid JSON: Expecting")
    assert failed[3] == "line 3: missing 'image'"
    assert failed[4].startswith("line 4: image file not found")
    assert failed[5] == "line 5: expected a JSON object with 'image'"
    assert [(r["line"], r["caption"]) for r in rows if "caption" in r] == list(
        zip([1, 6], expected_captions(model_dir, images[:2], max_length=6)))
    assert capsys.readouterr().err.splitlines()[-1].startswith("vlfuse caption: 4 of 6 rows failed (lines 2, 3, 4, 5)")


def test_cli_attention_maps_draw_every_head_for_every_generated_word(model_dir, images, tmp_path, capsys):
    maps = tmp_path / "maps"
    args = ["caption", "--model", str(model_dir), "--image", str(images[0]), "--max-length", "3",
            "--attention-maps", str(maps), "--attention-layers", "1"]
    assert vlfuse_main(args) == 0
    sidecar = json.loads((maps / "row_0.json").read_text())
    words = sidecar["words"]
    assert 1 <= len(words) <= 3
    assert sidecar["png"] == [f"row_0_layer1_word{t:02d}.png" for t in range(len(words))]
    assert all((maps / name).stat().st_size > 0 for name in sidecar["png"])
    weights = np.load(maps / "row_0.npz")["layer_1"]  # (heads, words, prefix + patches)
    assert weights.shape == (16, len(words), 10)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-5)
    assert f"wrote {len(words)} attention maps to {maps}" in capsys.readouterr().err


def test_vlfuse_help_lists_caption(capsys):
    assert vlfuse_main(["--help"]) == 0
    assert "caption" in capsys.readouterr().out


def test_a_short_fit_of_a_tiny_caption_config_exports_a_caption_model(tmp_path, capsys):
    args = [
        "fit", "--config", str(REPO / "configs" / "shapes_captions.yaml"),
        *tiny_caption_overrides(),
        "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
        f"--checkpoint.dirpath={tmp_path / 'checkpoints'}",
        "--threads=1",
    ]
    assert vlfuse_main(args) == 0
    model = CaptionModel.from_pretrained(tmp_path / "version_0" / "model")  # the run folder's
    assert model.config.dim == 16
    assert "a" in model.tokenizer.get_vocab() and "triangle" in model.tokenizer.get_vocab()
    summary = capsys.readouterr().out.splitlines()[-1]
    assert summary.startswith("vlfuse: test BLEU-4 ") and "fact precision" in summary and summary.endswith(
        f"(8 images); model saved to {tmp_path / 'version_0' / 'model'}")
