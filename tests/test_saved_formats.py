"""Models saved in earlier formats load and answer exactly as they did when they were saved.

- tests/fixtures/format_v1 (written at commit 18cf907 by its make.py): tiny untrained models of
  format 1, one with pruned heads, one map-program reader;
- tests/fixtures/format_v2 (written at commit 9496edb, the last before the model became parts, by
  its make.py): the default easy-VQA model trained for 10 epochs, a SHAPES fusion model (the
  cell-steps reader) and a caption model.

Each folder keeps the inputs, the logits of the forward pass and the answers or captions that code
gave; any later refactor must reproduce them.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vlfuse import Captioner, Predictor, VLFuseModel
from vlfuse.captioning import CaptionModel

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ANSWERING = [
    "format_v1/pool_swiglu_gate_pruned",
    "format_v1/pool_gelu_leaky_relu",
    "format_v1/shapes_map_program",
    "format_v2/easy_vqa_default",
    "format_v2/shapes_fusion",
]
CAPTIONS = FIXTURES / "format_v2" / "shapes_captions"


def pair_images(directory: Path, expected: dict) -> list[str]:
    """The image of each question: named in expected.json (format 2), else image{i}.png (format 1)."""
    names = expected.get("images") or [f"image{i}.png" for i in range(len(expected["questions"]))]
    return [str(directory / name) for name in names]


@pytest.mark.parametrize("name", ANSWERING)
def test_saved_model_gives_the_logits_it_gave_when_saved(name):
    directory = FIXTURES / name
    expected = load_file(directory / "expected.safetensors")
    questions = json.loads((directory / "expected.json").read_text())["questions"]
    model = VLFuseModel.from_pretrained(directory / "model")
    tokens = model.processor.tokenize(questions)
    with torch.no_grad():
        logits = model(expected["pixel_values"], **tokens, image_index=expected.get("image_index")).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ANSWERING)
def test_predictor_gives_the_answers_it_gave_when_saved(name):
    directory = FIXTURES / name
    expected = json.loads((directory / "expected.json").read_text())
    images = pair_images(directory, expected)
    predictions = Predictor.from_pretrained(directory / "model").predict(images, expected["questions"], top_k=2)
    for got, want in zip(predictions, expected["predictions"], strict=True):
        assert got["answer"] == want["answer"]
        assert got["score"] == pytest.approx(want["score"], abs=1e-5)
        assert [t["answer"] for t in got["top_k"]] == [t["answer"] for t in want["top_k"]]
        assert [t["score"] for t in got["top_k"]] == pytest.approx([t["score"] for t in want["top_k"]], abs=1e-5)


def test_an_earlier_format_loads_as_parts_and_saves_as_the_current_one(tmp_path):
    """A format-2 model becomes a fuser and a head, and saved again it is the same model."""
    model = VLFuseModel.from_pretrained(FIXTURES / "format_v2" / "shapes_fusion" / "model")
    assert (model.config.fuser.type, model.config.head.type) == ("cell_steps", "existence")
    assert model.has_fusion_heads and model.num_fusion_layers == 1  # the shared block's 16 heads
    model.save_pretrained(tmp_path / "again")
    meta = json.loads((tmp_path / "again" / "config.json").read_text())
    assert meta["format_version"] == 3 and meta["config"]["fuser"]["type"] == "cell_steps"
    again = VLFuseModel.from_pretrained(tmp_path / "again")
    for (key, value), (key_again, value_again) in zip(model.state_dict().items(), again.state_dict().items(), strict=True):
        assert key == key_again and torch.equal(value, value_again)


def test_pruned_fixture_really_has_fewer_heads():
    model = VLFuseModel.from_pretrained(FIXTURES / "format_v1" / "pool_swiglu_gate_pruned" / "model")
    assert [layer.num_heads for layer in model.attention_layers] == [13, 15]


def test_caption_model_gives_the_logits_it_gave_when_saved():
    expected = load_file(CAPTIONS / "expected.safetensors")
    model = CaptionModel.from_pretrained(CAPTIONS / "model")
    with torch.no_grad():
        logits = model(expected["pixel_values"], expected["input_ids"])
    torch.testing.assert_close(logits, expected["logits"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("decoding", ["greedy", "beam3"])
def test_captioner_writes_the_captions_it_wrote_when_saved(decoding):
    expected = json.loads((CAPTIONS / "expected.json").read_text())
    captioner = Captioner.from_pretrained(CAPTIONS / "model")
    images = [str(CAPTIONS / name) for name in expected["images"]]
    got = captioner.caption(images, beam_size=1 if decoding == "greedy" else 3)
    assert [c["caption"] for c in got] == [c["caption"] for c in expected[decoding]]
    assert [c["score"] for c in got] == pytest.approx([c["score"] for c in expected[decoding]], abs=1e-5)


@pytest.mark.parametrize(("readout", "old", "new"), [
    ("bilinear", "model.fusion.blocks.0.cross_attn.q_proj.weight", "model.fuser.stack.blocks.0.cross_attn.q_proj.weight"),
    ("bilinear", "model.readout.products.weight", "model.head.products.weight"),
    ("cell_steps", "model.readout.step.cross_attn.q_proj.weight", "model.fuser.step.cross_attn.q_proj.weight"),
    ("cell_steps", "model.readout.existence.bias", "model.head.bias"),
])
def test_a_lightning_checkpoint_of_format_2_gets_its_weights_renamed_when_loaded(readout, old, new):
    """``--ckpt_path`` of a run started before the parts: the checkpoint has no ``vlfuse_format``."""
    from vlfuse.lit import VLFuseLitModule

    value = torch.ones(2)
    checkpoint = {"state_dict": {old: value, "model.image_proj.weight": value},
                  "hyper_parameters": {"architecture": {"readout": readout}}}
    VLFuseLitModule().on_load_checkpoint(checkpoint)
    assert checkpoint["state_dict"] == {new: value, "model.image_proj.weight": value}
    current = {"state_dict": {new: value}, "vlfuse_format": 3}
    VLFuseLitModule().on_load_checkpoint(current)
    assert current["state_dict"] == {new: value}  # a checkpoint of this format is left as it is
