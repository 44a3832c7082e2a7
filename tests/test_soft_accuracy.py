"""VQA soft accuracy: the metric, the human answers in batches, and its logging in validation/test."""

import itertools
import random
import shutil
from pathlib import Path

import lightning as L
import pytest
import torch
from PIL import Image

from vlfuse.data import IGNORE_INDEX, AnswerVocab, GroupedVQADataset, ImageQuestions, collate_grouped
from vlfuse.data.dataset import NO_ANSWER, human_labels
from vlfuse.data.vqa_v2 import vqa_accuracy
from vlfuse.datamodules.easy_vqa import EasyVQADataModule
from vlfuse.datamodules.vqa_v2 import VQAv2DataModule
from vlfuse.lit import VLFuseLitModule
from vlfuse.metrics import VQASoftAccuracy

from conftest import tiny_config

FIXTURES = Path(__file__).parent / "fixtures" / "vqa_v2"


def leave_one_out_by_hand(prediction: int, humans: list[int]) -> float:
    """The official definition spelt out: min(matches / 3, 1) averaged over the subsets of all but one."""
    subsets = list(itertools.combinations(humans, len(humans) - 1))
    return sum(min(1.0, subset.count(prediction) / 3) for subset in subsets) / len(subsets)


def score(preds, rows) -> float:
    metric = VQASoftAccuracy()
    metric.update(torch.as_tensor(preds), human_labels(rows))
    return metric.compute().item()


@pytest.mark.parametrize("agreeing, expected", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)])
def test_ten_humans_give_the_official_scores(agreeing, expected):
    # 2 of 10 by hand: leaving out one of the 2 leaves 1/3 (2 subsets), one of the 8 leaves 2/3 (8): 6/10
    humans = [7] * agreeing + [1] * (10 - agreeing)
    assert score([7], [humans]) == pytest.approx(expected)
    assert leave_one_out_by_hand(7, humans) == pytest.approx(expected)


@pytest.mark.parametrize(
    "humans, expected",
    [
        ([7, 1, 2], (0 + 1 / 3 + 1 / 3) / 3),  # 1 of 3
        ([7, 7, 2], (1 / 3 + 1 / 3 + 2 / 3) / 3),  # 2 of 3
        ([7, 7, 7, 7], 1.0),  # every subset of 3 holds 3 matches
        ([7], 1.0),  # one human answer: exact match
        ([1], 0.0),
    ],
)
def test_fewer_than_ten_humans(humans, expected):
    assert score([7], [humans]) == pytest.approx(expected)


def test_metric_agrees_with_the_definition_and_the_string_function_on_random_cases():
    rng = random.Random(0)
    rows = [[rng.randrange(4) for _ in range(rng.randint(2, 10))] for _ in range(200)]
    preds = [rng.randrange(4) for _ in rows]
    by_hand = [leave_one_out_by_hand(p, row) for p, row in zip(preds, rows)]
    strings = [vqa_accuracy(str(p), [str(h) for h in row], normalize=False) for p, row in zip(preds, rows)]
    assert strings == pytest.approx(by_hand)
    assert score(preds, rows) == pytest.approx(sum(by_hand) / len(by_hand))


def test_logits_accumulate_over_updates_padding_is_skipped_and_unknown_answers_count():
    metric = VQASoftAccuracy()
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 0.0]])  # predicts 1, then 0
    # question 1: 3 human answers, one of them outside the vocabulary (it counts, never matches)
    metric.update(logits, torch.tensor([[1, IGNORE_INDEX, 2], [0, 0, 0]]))
    # a question without any human answer (all padding) is left out
    metric.update(torch.tensor([2, 2]), torch.tensor([[2, NO_ANSWER, NO_ANSWER], [NO_ANSWER] * 3]))
    expected = [(0 + 1 / 3 + 1 / 3) / 3, 2 / 3, 1.0]  # 1 of 3; 3 of 3 (subsets of 2 hold 2); 1 of 1
    assert metric.compute().item() == pytest.approx(sum(expected) / 3)
    assert VQASoftAccuracy().compute().item() == 0.0


def test_collate_pads_human_labels_and_leaves_them_out_when_no_record_has_them():
    vocab = AnswerVocab(["yes", "no", "red"])
    records = [
        ImageQuestions(Image.new("RGB", (8, 8)), ["q1", "q2"], ["yes", "red"], human_answers=[["yes", "no"], ["red", "blue", "red"]]),
        ImageQuestions(Image.new("RGB", (8, 8)), ["q3"], ["no"]),
    ]
    data = GroupedVQADataset(records, vocab, image_size=8)
    batch = collate_grouped([data[0], data[1]])
    assert batch["human_labels"].tolist() == [[0, 1, NO_ANSWER], [2, IGNORE_INDEX, 2], [NO_ANSWER] * 3]
    assert "human_labels" not in collate_grouped([data[1]])


@pytest.fixture
def vqa_dir(tmp_path):
    for path in FIXTURES.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    for split, image_ids in {"train2014": [9, 25, 30], "val2014": [42]}.items():
        (tmp_path / split).mkdir()
        for image_id in image_ids:
            Image.new("RGB", (16, 16), (image_id, 100, 200)).save(tmp_path / split / f"COCO_{split}_{image_id:012d}.jpg")
    return tmp_path


def validate_and_test(datamodule) -> dict:
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False)
    module = VLFuseLitModule(tiny_config())
    metrics = dict(trainer.validate(module, datamodule=datamodule, verbose=False)[0])
    metrics.update(trainer.test(module, datamodule=datamodule, verbose=False)[0])
    return metrics


def test_validation_and_test_log_soft_accuracy_when_the_data_has_human_answers(vqa_dir, one_thread):
    dm = VQAv2DataModule(data_dir=str(vqa_dir), val_fraction=0.34, top_k_answers=3, batch_size=2)
    metrics = validate_and_test(dm)
    assert {"val/acc", "val/soft_acc", "test/acc", "test/soft_acc"} <= set(metrics)
    assert 0.0 <= metrics["test/soft_acc"] <= 1.0


def test_exact_match_only_without_human_answers(one_thread):
    metrics = validate_and_test(EasyVQADataModule(limit_images=2, batch_size=2))
    assert "val/acc" in metrics and "test/acc" in metrics
    assert not any(name.endswith("soft_acc") for name in metrics)
