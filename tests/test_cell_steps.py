"""The cell-steps readout (configs/shapes_fusion.yaml): a one-number state per grid cell,
updated word by word by one shared 16-head fusion block."""

import pytest
import torch

from vlfuse.encoders import TextEncoderConfig
from vlfuse.model import VLFuseModel
from vlfuse.readouts.cell_steps import CellStepsReadout

from conftest import parameters_without_gradient, reader_config

QUESTIONS = ["is a red shape a square", "is a circle left of a square", "is a circle red"]


def cell_steps_model() -> VLFuseModel:
    config = reader_config(readout="cell_steps", mlp_type="swiglu", output_gate=True, dropout=0.0)
    torch.manual_seed(0)
    return VLFuseModel.from_config(config, ["false", "true"], QUESTIONS)


def answer(model: VLFuseModel, pixels: torch.Tensor, questions: list[str], index: torch.Tensor) -> torch.Tensor:
    tokens = model.tokenize(questions)
    return model(pixels, tokens["input_ids"], tokens["attention_mask"], image_index=index).logits


def test_every_parameter_gets_a_gradient_and_the_step_has_16_heads():
    model = cell_steps_model()
    assert isinstance(model.readout, CellStepsReadout) and model.readout.step.cross_attn.num_heads == 16
    logits = answer(model, torch.rand(2, 3, 32, 32), QUESTIONS, torch.tensor([0, 1, 1]))
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
        together = answer(model, pixels, QUESTIONS, torch.arange(3))  # padded to the longest question
        for i, question in enumerate(QUESTIONS):
            alone = answer(model, pixels[i : i + 1], [question], torch.zeros(1, dtype=torch.long))
            torch.testing.assert_close(alone[0], together[i], atol=1e-5, rtol=0)


def test_the_answer_is_the_existence_of_the_final_set():
    """An empty set (every cell's m near 0) answers false; the full start set answers true."""
    readout = cell_steps_model().readout
    full = readout.existence(torch.logsumexp(torch.zeros(1, 16), dim=1))
    empty = readout.existence(torch.logsumexp(torch.full((1, 16), -30.0), dim=1))
    assert full.argmax(-1).item() == 1 and empty.argmax(-1).item() == 0


def test_saves_and_loads_with_identical_logits(tmp_path):
    model = cell_steps_model().eval()
    pixels, index = torch.rand(2, 3, 32, 32), torch.tensor([0, 1, 1])
    loaded = VLFuseModel.from_pretrained(model.save_pretrained(tmp_path / "model")).eval()
    assert loaded.config.readout == "cell_steps"
    with torch.no_grad():
        torch.testing.assert_close(answer(loaded, pixels, QUESTIONS, index), answer(model, pixels, QUESTIONS, index), rtol=0, atol=0)


@pytest.mark.parametrize("answers", [["no", "yes", "red"], ["yes"]])
def test_it_needs_two_answers(answers):
    with pytest.raises(ValueError, match="two answers|at least 2 answers"):
        VLFuseModel.from_config(reader_config(readout="cell_steps"), answers, QUESTIONS)


def test_it_refuses_text_layers_it_would_not_use():
    config = reader_config(readout="cell_steps", text=TextEncoderConfig(width=32, depth=2, num_heads=2, max_length=16))
    with pytest.raises(ValueError, match="readout 'cell_steps' .* set text.depth to 0"):
        VLFuseModel.from_config(config, ["false", "true"], QUESTIONS)
