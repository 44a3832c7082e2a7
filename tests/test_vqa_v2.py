import json
import logging
import shutil
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from vlfuse.data.vqa_v2 import (
    VQAFormatError,
    load_vqa_v2,
    majority_answer,
    normalize_answer,
    vqa_accuracy,
)
from vlfuse.datamodules.vqa_v2 import VQAv2DataModule

FIXTURES = Path(__file__).parent / "fixtures" / "vqa_v2"
IMAGES = {"train2014": [9, 25, 30], "val2014": [42]}


@pytest.fixture
def vqa_dir(tmp_path):
    """The fixture JSON files, with small JPEG images in COCO names written next to them."""
    for path in FIXTURES.glob("*.json"):
        shutil.copy(path, tmp_path / path.name)
    for split, image_ids in IMAGES.items():
        (tmp_path / split).mkdir()
        for i, image_id in enumerate(image_ids):
            image = Image.new("RGB", (24, 16), (40 * i, 100, 200))
            image.save(tmp_path / split / f"COCO_{split}_{image_id:012d}.jpg")
    return tmp_path


def load_train(root: Path, **kwargs):
    return load_vqa_v2(
        root / "v2_OpenEnded_mscoco_train2014_questions.json",
        root / "v2_mscoco_train2014_annotations.json",
        root / "train2014",
        **kwargs,
    )


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


# ------------------------------------------------------------------------------ normalisation


@pytest.mark.parametrize(
    "raw, normalised",
    [
        ("Yes", "yes"),
        ("yes.", "yes"),
        ("Yes!", "yes"),
        ("two", "2"),
        ("Ten.", "10"),
        ("none", "0"),
        ("2.5", "2.5"),  # a period before a digit stays
        ("3.", "3"),
        ("1,000", "1000"),  # digit-comma-digit: every mark is dropped
        ("red, white", "red white"),  # a mark next to a space is dropped
        ("red,white", "red white"),  # a mark inside a word becomes a space
        ("t-shirt", "t shirt"),
        ("on/off", "on off"),
        ("a (red) ball", "red ball"),
        ("the dog", "dog"),
        ("  A Man\tin a hat\n", "man in hat"),
        ("dont", "don't"),
        ("isnt", "isn't"),
        ("it's", "it's"),  # apostrophes are kept
        ("10:30", "10:30"),  # so are colons
        ("black & white", "black & white"),
        ("What?", "what"),
    ],
)
def test_answer_normalisation_follows_the_official_rules(raw, normalised):
    assert normalize_answer(raw) == normalised
    assert normalize_answer(normalised) == normalised  # idempotent


# ------------------------------------------------------------------------------- soft accuracy


@pytest.mark.parametrize("matches, expected", [(0, 0.0), (1, 0.3), (2, 0.6), (3, 0.9), (4, 1.0), (10, 1.0)])
def test_soft_accuracy_averages_over_leave_one_out_subsets(matches, expected):
    # by hand, m = 2: the 2 matching annotators left out leave 1 match (1/3), the 8 others 2 (2/3):
    # (2 * 1/3 + 8 * 2/3) / 10 = 0.6
    humans = ["cat"] * matches + ["dog"] * (10 - matches)
    assert vqa_accuracy("cat", humans) == pytest.approx(expected)


def test_soft_accuracy_normalises_answers_and_handles_other_counts():
    humans = ["Two", "2", "two.", "3", "3", "3", "3", "4", "4", "4"]
    assert vqa_accuracy("2", humans) == pytest.approx(0.9)  # 3 humans said 2 once normalised
    assert vqa_accuracy("two", humans) == pytest.approx(0.9)
    assert vqa_accuracy("2", humans, normalize=False) == pytest.approx(0.3)
    # three annotators, two agree: leaving out either match leaves 1 (1/3), the other leaves 2 (2/3)
    assert vqa_accuracy("a", ["a", "a", "b"]) == pytest.approx((1 / 3 + 1 / 3 + 2 / 3) / 3)
    assert vqa_accuracy("a", ["a"]) == 1.0
    with pytest.raises(ValueError, match="at least one human answer"):
        vqa_accuracy("a", [])


def test_majority_answer_breaks_ties_by_first_given():
    assert majority_answer(["no", "yes", "yes", "no"]) == "no"
    assert majority_answer(["2", "3", "3"]) == "3"


# ------------------------------------------------------------------------------------ loading


def test_load_groups_questions_by_image_with_normalised_answers(vqa_dir):
    data = load_train(vqa_dir)
    assert [r.image_id for r in data.records] == ["9", "25", "30"]
    assert data.question_ids == [[9000, 9001], [25000], [30000]]
    first = data.records[0]
    assert first.image == str(vqa_dir / "train2014" / "COCO_train2014_000000000009.jpg")
    assert first.questions == ["How many dogs are there?", "Is this a kitchen?"]
    assert first.answers == ["2", "yes"]
    assert first.human_answers[0] == ["2", "2", "2", "2", "3", "2", "2", "3", "2", "1"]
    assert data.records[1].human_answers[0].count("red") == 7 and "red white" in data.records[1].human_answers[0]
    assert data.records[2].answers == ["frisbee"]
    assert data.skipped == {}
    assert vqa_accuracy("3", first.human_answers[0]) == pytest.approx(0.6)


def test_load_without_annotations_and_with_an_image_pattern(vqa_dir):
    (vqa_dir / "train2014" / "COCO_train2014_000000000009.jpg").rename(vqa_dir / "train2014" / "9.jpg")
    (vqa_dir / "train2014" / "COCO_train2014_000000000025.jpg").rename(vqa_dir / "train2014" / "25.jpg")
    (vqa_dir / "train2014" / "COCO_train2014_000000000030.jpg").rename(vqa_dir / "train2014" / "30.jpg")
    data = load_vqa_v2(
        vqa_dir / "v2_OpenEnded_mscoco_train2014_questions.json",
        None,
        vqa_dir / "train2014",
        image_pattern="{image_id}.jpg",
    )
    assert [Path(r.image).name for r in data.records] == ["9.jpg", "25.jpg", "30.jpg"]
    assert all(r.answers == [] and r.human_answers == [] for r in data.records)


def test_missing_image_names_the_file(vqa_dir):
    (vqa_dir / "train2014" / "COCO_train2014_000000000025.jpg").unlink()
    with pytest.raises(FileNotFoundError, match=r"COCO_train2014_000000000025\.jpg \(image_id 25"):
        load_train(vqa_dir)


def test_malformed_question_record_names_file_index_and_question_id(vqa_dir):
    path = vqa_dir / "v2_OpenEnded_mscoco_train2014_questions.json"
    edit_json(path, lambda d: d["questions"][2].pop("question"))
    message = r"questions\.json: record 2 \(question_id 25000\): 'question' must be str"
    with pytest.raises(VQAFormatError, match=message):
        load_train(vqa_dir)


def test_malformed_annotation_record_names_file_index_and_question_id(vqa_dir):
    path = vqa_dir / "v2_mscoco_train2014_annotations.json"
    edit_json(path, lambda d: d["annotations"][3]["answers"][4].update(answer=7))
    message = r"annotations\.json: record 3 \(question_id 30000\), answer 4: 'answer' must be str"
    with pytest.raises(VQAFormatError, match=message):
        load_train(vqa_dir)


def test_invalid_json_names_file_and_line(vqa_dir):
    path = vqa_dir / "v2_mscoco_train2014_annotations.json"
    path.write_text(path.read_text().replace('"image_id": 25,', '"image_id": 25', 1))
    with pytest.raises(VQAFormatError, match=r"annotations\.json:\d+:\d+: not valid JSON"):
        load_train(vqa_dir)
    path.write_text('{"questions": []}')
    with pytest.raises(VQAFormatError, match=r"annotations\.json: expected a JSON object with a list under 'annot"):
        load_train(vqa_dir)


def test_question_without_annotation_names_it(vqa_dir):
    edit_json(vqa_dir / "v2_mscoco_train2014_annotations.json", lambda d: d["annotations"].pop(1))
    with pytest.raises(VQAFormatError, match=r"record 1 \(question_id 9001\): no annotation in .*annotations\.json"):
        load_train(vqa_dir)


def test_annotation_for_another_image_and_duplicates_raise(vqa_dir):
    edit_json(vqa_dir / "v2_mscoco_train2014_annotations.json", lambda d: d["annotations"][2].update(image_id=30))
    with pytest.raises(VQAFormatError, match=r"question_id 25000\): image_id 25, but its annotation .* says 30"):
        load_train(vqa_dir)
    edit_json(vqa_dir / "v2_mscoco_train2014_annotations.json", lambda d: d["annotations"][2].update(image_id=25))
    questions = vqa_dir / "v2_OpenEnded_mscoco_train2014_questions.json"
    edit_json(questions, lambda d: d["questions"].append(d["questions"][0]))
    with pytest.raises(VQAFormatError, match=r"record 4 \(question_id 9000\): question_id 9000 appears twice"):
        load_train(vqa_dir)


def test_skip_bad_counts_every_kind_of_bad_data(vqa_dir, caplog):
    questions = vqa_dir / "v2_OpenEnded_mscoco_train2014_questions.json"
    edit_json(questions, lambda d: d["questions"][3].update(image_id="30"))
    edit_json(vqa_dir / "v2_mscoco_train2014_annotations.json", lambda d: d["annotations"][1].update(answers=[]))
    (vqa_dir / "train2014" / "COCO_train2014_000000000025.jpg").unlink()
    with caplog.at_level(logging.WARNING, logger="vlfuse.data.vqa_v2"):
        data = load_train(vqa_dir, skip_bad=True)
    assert data.skipped == {
        "malformed annotation records": 1,
        "malformed question records": 1,
        "questions without annotations": 1,
        "questions whose image is missing": 1,
    }
    assert "skipped 1 malformed annotation records" in caplog.text
    assert [r.image_id for r in data.records] == ["9"]
    assert data.records[0].questions == ["How many dogs are there?"] and data.question_ids == [[9000]]


# -------------------------------------------------------------------------------- data module


def test_datamodule_splits_vocab_and_batches(vqa_dir):
    dm = VQAv2DataModule(data_dir=str(vqa_dir), val_fraction=0.34, top_k_answers=2, image_size=16, batch_size=2)
    train, val, test = dm.records("train"), dm.records("val"), dm.records("test")
    assert len(train) == 2 and len(val) == 1
    assert {r.image_id for r in train + val} == {"9", "25", "30"}
    assert [r.image_id for r in test] == ["42"]  # the official val split is the held-out test
    assert test[0].answers == ["pizza", "no"]
    train_answers = Counter(a for r in train for a in r.answers)
    assert dm.answers == sorted(train_answers, key=lambda a: (-train_answers[a], a))[:2]
    batch = next(iter(dm.test_dataloader()))
    assert batch["pixel_values"].shape == (1, 3, 16, 16)
    assert batch["questions"] == ["What is on the plate?", "Is it sunny?"]
    assert batch["labels"].shape == (2,)


def test_datamodule_checks_its_arguments_and_names_missing_files(tmp_path, vqa_dir):
    with pytest.raises(ValueError, match="val_fraction"):
        VQAv2DataModule(data_dir=str(vqa_dir), val_fraction=0.0)
    with pytest.raises(ValueError, match="top_k_answers"):
        VQAv2DataModule(data_dir=str(vqa_dir), top_k_answers=0)
    dm = VQAv2DataModule(data_dir=str(vqa_dir), test_split="test2015")
    with pytest.raises(FileNotFoundError, match=r"v2_mscoco_test2015_annotations\.json"):
        dm.records("test")
