"""Models saved in format version 1 (by commit 18cf907) load and answer exactly as they did then.

tests/fixtures/format_v1/make.py wrote each model with its inputs, the logits of
``VLFuseModel.forward`` and the answers of ``Predictor.predict`` at that commit; any later
refactor must reproduce them.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vlfuse import Predictor, VLFuseModel

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "format_v1"
NAMES = ["pool_swiglu_gate_pruned", "pool_gelu_leaky_relu", "shapes_map_program"]


@pytest.mark.parametrize("name", NAMES)
def test_saved_model_gives_the_logits_it_gave_when_saved(name):
    expected = load_file(FIXTURES / name / "expected.safetensors")
    questions = json.loads((FIXTURES / name / "expected.json").read_text())["questions"]
    model = VLFuseModel.from_pretrained(FIXTURES / name / "model")
    tokens = model.tokenize(questions)
    with torch.no_grad():
        logits = model(expected["pixel_values"], tokens["input_ids"], tokens["attention_mask"]).logits
    torch.testing.assert_close(logits, expected["logits"], atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_predictor_gives_the_answers_it_gave_when_saved(name):
    expected = json.loads((FIXTURES / name / "expected.json").read_text())
    questions = expected["questions"]
    images = [str(FIXTURES / name / f"image{i}.png") for i in range(len(questions))]
    predictions = Predictor.from_pretrained(FIXTURES / name / "model").predict(images, questions, top_k=2)
    for got, want in zip(predictions, expected["predictions"], strict=True):
        assert got["answer"] == want["answer"]
        assert got["score"] == pytest.approx(want["score"], abs=1e-5)
        assert [t["answer"] for t in got["top_k"]] == [t["answer"] for t in want["top_k"]]
        assert [t["score"] for t in got["top_k"]] == pytest.approx([t["score"] for t in want["top_k"]], abs=1e-5)


def test_pruned_fixture_really_has_fewer_heads():
    model = VLFuseModel.from_pretrained(FIXTURES / "pool_swiglu_gate_pruned" / "model")
    assert [block.cross_attn.num_heads for block in model.fusion.blocks] == [13, 15]
