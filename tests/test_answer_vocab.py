"""Answer vocabularies matched by name (issue 37): a saved model tested or fine-tuned on data whose
answers come in another order, are a subset, or include answers the model lacks."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlfuse.cli import main, run_lightning
from vlfuse.data import AnswerVocab, GroupedVQADataset, collate_grouped
from vlfuse.data.imagefolder import load_imagefolder_split
from vlfuse.model import VLFuseModel

from conftest import COLOUR_ANSWERS, REPO, logits, make_model, reader_config, tiny_cli_args

CONFIG = REPO / "configs" / "imagefolder_vqa.yaml"
QUESTIONS = ["what color is the shape?", "is there a red shape?", "is there a blue shape?"]
IMAGES = [f"{i}.png" for i in range(6)]
ANSWER_COUNTS = {"blue": 4, "yes": 3, "no": 2, "red": 1}
"""Training answers of a data folder, by count: its own classes are these, most frequent first
(another order than the model's :data:`~conftest.COLOUR_ANSWERS`)."""


def write_split(folder: Path, rows: list[tuple[str, str, str]]) -> None:
    """``rows`` of (file name, question, answer); each image is noise seeded by its name."""
    folder.mkdir(parents=True)
    for name in dict.fromkeys(name for name, _, _ in rows):
        pixels = np.random.default_rng(int(name.split(".")[0])).integers(0, 256, (32, 32, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / name)
    lines = [json.dumps({"file_name": n, "question": q, "answer": a}) for n, q, a in rows]
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n")


def training_rows(counts: dict[str, int]) -> list[tuple[str, str, str]]:
    """``counts[a]`` training questions answered ``a``, over the images in turn."""
    answers = [a for a, n in counts.items() for _ in range(n)]
    return [(IMAGES[i % len(IMAGES)], QUESTIONS[i % len(QUESTIONS)], a) for i, a in enumerate(answers)]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, VLFuseModel]:
    """A tiny model over :data:`COLOUR_ANSWERS` whose answers vary with the image, saved and loaded."""
    model, batch = make_model(fuser={"gated": False})  # (gates at 0 would hide the image)
    with torch.no_grad():  # centre the scores: each answer is the best for some questions
        model.head.classifier[-1].bias -= logits(model.eval(), batch).mean(0)
    directory = tmp_path_factory.mktemp("saved") / "model"
    model.save_pretrained(directory)
    return directory, VLFuseModel.from_pretrained(directory)


def answers_of(model: VLFuseModel, folder: Path) -> list[str]:
    """What ``model`` answers to each question of the split ``folder`` (rows of one image together)."""
    dataset = GroupedVQADataset(load_imagefolder_split(folder).records, AnswerVocab(model.answers), 32)
    with torch.no_grad():
        best = logits(model.eval(), collate_grouped([dataset[i] for i in range(len(dataset))])).argmax(-1)
    return [model.answers[i] for i in best]


@pytest.fixture(scope="module")
def predicted(saved, tmp_path_factory) -> list[tuple[str, str, str]]:
    """Test rows (every image, every question) answered as the saved model answers them."""
    folder = tmp_path_factory.mktemp("unanswered") / "test"
    questions = [(name, q) for name in IMAGES for q in QUESTIONS]
    write_split(folder, [(name, q, "no") for name, q in questions])
    rows = [(name, q, answer) for (name, q), answer in zip(questions, answers_of(saved[1], folder))]
    assert len({a for _, _, a in rows}) >= 2  # the model's ids matter
    return rows


def data_folder(root: Path, train: list, test: list) -> Path:
    """An imagefolder of ``train`` and ``test`` rows, and a validation split of the first test rows."""
    for split, rows in (("train", train), ("validation", test[:4]), ("test", test)):
        write_split(root / "data" / split, rows)
    return root / "data"


def lightning(root: Path, command: str, data: Path, *extra: str):
    """``vlfuse COMMAND`` of the tiny imagefolder config on ``data``, writing under ``root``."""
    return run_lightning([command, "--config", str(CONFIG), *tiny_cli_args(root), f"--data.init_args.data_dir={data}", *extra])


def with_answers(rows: list, answers: dict[int, str]) -> list:
    """``rows`` with the answer of row ``i`` replaced by ``answers[i]``."""
    return [(n, q, answers.get(i, a)) for i, (n, q, a) in enumerate(rows)]


@pytest.mark.parametrize("counts", [ANSWER_COUNTS, {"red": 4, "no": 3, "yes": 2, "blue": 1}, {"red": 2, "no": 1}],
                         ids=["reordered", "reordered-again", "subset"])
def test_the_data_is_scored_on_the_models_own_answer_ids(saved, predicted, counts, tmp_path, capsys):
    directory, model = saved
    wrong = {i: next(a for a in ("red", "blue") if a != answer) for i, (_, _, answer) in enumerate(predicted) if i % 3 == 0}
    test = with_answers(predicted, wrong)
    data = data_folder(tmp_path, training_rows(counts), test)
    cli = lightning(tmp_path, "test", data, f"--model.pretrained={directory}")
    assert cli.datamodule.data_vocab.answers == list(counts) != model.answers
    expected = 1 - len(wrong) / len(test)
    assert float(cli.trainer.callback_metrics["test/acc"]) == pytest.approx(expected, abs=1e-6)
    assert "vlfuse: warning" not in capsys.readouterr().err


def test_a_checkpoint_is_scored_on_its_own_answer_ids(predicted, tmp_path):
    """The same questions answered otherwise in training: the same tokenizer, another answer order."""
    fit = lightning(tmp_path / "fit", "fit", data_folder(tmp_path / "a", training_rows(ANSWER_COUNTS), predicted),
                    "--trainer.max_epochs=1")
    checkpoint = fit.trainer.checkpoint_callback.best_model_path
    trained = VLFuseModel.from_pretrained(tmp_path / "fit" / "model")
    counts = {"red": 4, "no": 3, "yes": 2, "blue": 1}
    cli = lightning(tmp_path / "test", "test", data_folder(tmp_path / "b", training_rows(counts), predicted),
                    f"--ckpt_path={checkpoint}")
    assert cli.model.model.answers == trained.answers == list(ANSWER_COUNTS) != cli.datamodule.data_vocab.answers
    given = answers_of(trained, tmp_path / "b" / "data" / "test")
    expected = np.mean([answer == row[2] for answer, row in zip(given, predicted)])
    assert float(cli.trainer.callback_metrics["test/acc"]) == pytest.approx(expected, abs=1e-6)


def test_an_answer_the_model_lacks_counts_wrong_with_one_warning(saved, predicted, tmp_path, capsys):
    test = with_answers(predicted, {0: "green", 4: "green", 5: "circle"})
    cli = lightning(tmp_path, "test", data_folder(tmp_path, training_rows(ANSWER_COUNTS), test), f"--model.pretrained={saved[0]}")
    metrics = cli.trainer.callback_metrics
    assert float(metrics["test/acc"]) == pytest.approx(1 - 3 / len(test), abs=1e-6)
    assert int(metrics["test/questions"]) == len(test)
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("vlfuse: warning")]
    assert warnings == [
        f"vlfuse: warning: 3 of the {len(test)} test questions have an answer outside the model's 4 "
        "('green', 'circle'): counted wrong"
    ]


def test_fine_tuning_on_an_answer_the_model_lacks_needs_new_answers_extend(saved, predicted, tmp_path, capsys):
    data = data_folder(tmp_path, training_rows({**ANSWER_COUNTS, "green": 1}), predicted)
    code = main([
        "fit", "--config", str(CONFIG), *tiny_cli_args(tmp_path), f"--data.init_args.data_dir={data}",
        f"--model.pretrained={saved[0]}",
    ])
    assert code == 2
    line = next(line for line in capsys.readouterr().err.splitlines() if line.startswith("vlfuse: error:"))
    assert "lacks 1 of the training data's answers ('green')" in line and "--model.new_answers extend" in line


def test_fine_tuning_with_extend_appends_the_new_answers_and_exports_the_model(saved, predicted, tmp_path):
    data = data_folder(tmp_path, training_rows({**ANSWER_COUNTS, "green": 2, "circle": 1}), predicted)
    cli = lightning(tmp_path, "fit", data, f"--model.pretrained={saved[0]}", "--model.new_answers=extend", "--trainer.max_epochs=1")
    assert cli.model.model.answers == [*COLOUR_ANSWERS, "green", "circle"]
    exported = VLFuseModel.from_pretrained(tmp_path / "model")
    assert exported.answers == [*COLOUR_ANSWERS, "green", "circle"]
    assert exported.head.classifier[-1].out_features == 6


def old_rows(model: VLFuseModel, count: int) -> dict[str, torch.Tensor]:
    """The head's parameters, each cut to its first ``count`` output rows where it scores answers."""
    return {name: p[:count].clone() if p.shape[0] == len(model.answers) else p.clone() for name, p in model.head.named_parameters()}


@pytest.mark.parametrize("head", ["pooled", "bilinear"])
def test_extend_grows_the_head_keeps_the_old_rows_and_round_trips(head, tmp_path):
    model, batch = make_model(head={"type": head})
    model.eval()
    before, rows = logits(model, batch).detach(), old_rows(model, len(COLOUR_ANSWERS))
    model.add_answers(["green", "circle"])
    assert model.answers == [*COLOUR_ANSWERS, "green", "circle"]
    after = old_rows(model, len(COLOUR_ANSWERS))
    assert after.keys() == rows.keys() and all(torch.equal(after[k], rows[k]) for k in rows)
    scores = logits(model, batch).detach()
    assert scores.shape == (len(batch["questions"]), 6)
    torch.testing.assert_close(scores[:, :4], before)
    model.save_pretrained(tmp_path / "extended")
    loaded = VLFuseModel.from_pretrained(tmp_path / "extended")
    assert loaded.answers == model.answers and loaded.config == model.config
    assert torch.equal(logits(loaded, batch), scores)


def test_the_existence_head_refuses_to_grow_and_answers_must_be_new():
    model = VLFuseModel.from_config(reader_config(), ["false", "true"], ["is there a red circle?"])
    with pytest.raises(ValueError, match="^head 'existence' scores exactly two answers"):
        model.add_answers(["maybe"])
    with pytest.raises(ValueError, match=r"already known: \['yes'\]"):
        make_model()[0].add_answers(["green", "yes"])
