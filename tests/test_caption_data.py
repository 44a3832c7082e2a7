"""Captioning data: generated SHAPES scenes with grammar captions, and COCO captions in both layouts."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vlfuse.captioning.grammar import describe
from vlfuse.data.captions import CaptionDataset, ImageCaptions
from vlfuse.data.coco_captions import CaptionFormatError, load_coco_captions, load_karpathy_split
from vlfuse.data.shapes import read_scene
from vlfuse.datamodules import captions as caption_data
from vlfuse.datamodules.captions import CocoCaptionsDataModule, ShapesCaptionsDataModule, generate_scenes

from test_shapes import scene_of

SIZE = 16


def shapes_data(**overrides) -> ShapesCaptionsDataModule:
    options = dict(num_train_scenes=60, num_val_scenes=12, num_test_scenes=12, image_size=SIZE, batch_size=5)
    return ShapesCaptionsDataModule(**{**options, **overrides})


def all_batches(loader) -> list[dict]:
    return list(loader)


# ------------------------------------------------------------------------------------- SHAPES


def test_shapes_caption_batches_hold_images_grammar_captions_and_scenes():
    data = shapes_data()
    batch = next(iter(data.val_dataloader()))
    assert batch["pixel_values"].shape == (5, 3, SIZE, SIZE)
    assert batch["pixel_values"].dtype == torch.float32
    assert 0.0 <= batch["pixel_values"].min() and batch["pixel_values"].max() <= 1.0
    assert batch["captions"] == [describe(scene) for scene in batch["scenes"]]
    assert batch["references"] == [[caption] for caption in batch["captions"]]
    assert batch["image_ids"] == [f"shapes-captions/val/{i}" for i in range(5)]


def test_shapes_caption_images_show_the_scenes_their_captions_describe():
    data = shapes_data()
    for split in ("train", "val", "test"):
        for record in data.records(split):
            assert read_scene(record.image) == record.scene
            assert record.captions == [describe(record.scene)]


def test_val_and_test_scenes_are_fixed_and_never_trained_on():
    first, second = shapes_data(seed=0), shapes_data(seed=1, num_train_scenes=80)
    for split in ("val", "test"):
        assert first.scenes(split)[0] == second.scenes(split)[0]
        assert np.array_equal(first.scenes(split)[1], second.scenes(split)[1])
    assert first.scenes("val")[0] != first.scenes("test")[0]
    assert first.scenes("train")[0] != second.scenes("train")[0][:60]
    for data in (first, second):
        held_apart = set(data.scenes("val")[0] + data.scenes("test")[0])
        assert not held_apart & set(data.scenes("train")[0])


def test_generate_scenes_leaves_out_excluded_scenes_and_scenes_without_objects(monkeypatch):
    empty = scene_of(". . .", ". . .", ". . .")
    drawn = generate_scenes(20, np.random.default_rng(5))
    excluded = frozenset(drawn[:10])
    real_sample = caption_data.sample_scenes

    def with_an_empty_first_scene(count, rng):  # only in the first draw
        monkeypatch.setattr(caption_data, "sample_scenes", real_sample)
        return [empty, *real_sample(count - 1, rng)]

    monkeypatch.setattr(caption_data, "sample_scenes", with_an_empty_first_scene)
    scenes = generate_scenes(20, np.random.default_rng(5), exclude=excluded)
    assert len(scenes) == 20
    assert empty not in scenes
    assert not excluded & set(scenes)


def test_shapes_captions_check_the_scene_counts():
    with pytest.raises(ValueError, match="num_test_scenes must be at least 1, got 0"):
        shapes_data(num_test_scenes=0)


def test_caption_datamodules_have_no_answer_vocabulary():
    with pytest.raises(ValueError, match="ShapesCaptionsDataModule holds captions, not answers"):
        shapes_data().answers


# ------------------------------------------------------------------------------- caption choice


def test_training_captions_cycle_through_every_caption_of_an_image_one_per_epoch():
    records = [ImageCaptions(np.zeros((4, 4, 3), np.uint8), [f"caption {i}.{j}" for j in range(3)]) for i in range(4)]
    train = CaptionDataset(records, SIZE, train=True, seed=3)
    for index in range(len(records)):
        by_epoch = [train[(index, epoch)]["caption"] for epoch in range(4)]
        assert sorted(by_epoch[:3]) == records[index].captions
        assert by_epoch[3] == by_epoch[0]
    evaluation = CaptionDataset(records, SIZE)
    assert [evaluation[(0, epoch)]["caption"] for epoch in range(3)] == ["caption 0.0"] * 3
    assert train[(2, 0)]["references"] == records[2].captions


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_training_loader_gives_each_image_a_different_caption_each_epoch(coco_root, num_workers):
    data = CocoCaptionsDataModule(str(coco_root), karpathy_split="dataset_coco.json", image_size=SIZE, batch_size=2,
                                  num_workers=num_workers)  # fmt: skip
    loader = data.train_dataloader()
    seen: dict[str, list[str]] = {}
    for epoch in range(3):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            for image_id, caption in zip(batch["image_ids"], batch["captions"]):
                seen.setdefault(image_id, []).append(caption)
    references = {r.image_id: r.captions for r in data.records("train")}
    assert seen.keys() == references.keys()
    for image_id, captions in seen.items():
        assert sorted(captions) == sorted(references[image_id])  # each of the 3 captions once in 3 epochs


def test_a_resumed_training_loader_gives_the_captions_the_uninterrupted_one_would(coco_root):
    def loader():
        data = CocoCaptionsDataModule(str(coco_root), karpathy_split="dataset_coco.json", image_size=SIZE, batch_size=1)
        return data.train_dataloader()

    uninterrupted = loader()
    uninterrupted.sampler.set_epoch(1)
    captions = [batch["captions"] for batch in uninterrupted]
    interrupted = iter(uninterrupted)
    next(interrupted)
    resumed = loader()
    resumed.load_state_dict(uninterrupted.state_dict())  # one batch of epoch 1 handed out
    assert [batch["captions"] for batch in resumed] == captions[1:]


# --------------------------------------------------------------------------------- COCO files


def write_image(path: Path, colour: tuple[int, int, int]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (8, 6), colour).save(path)


def write_json(path: Path, data) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


def official_file(root: Path, split: str, image_ids: list[int], captions_per_image: int = 2) -> dict:
    """Write images and ``annotations/captions_<split>.json`` in the official layout; return its data."""
    images = [{"id": i, "file_name": f"COCO_{split}_{i:012d}.jpg", "width": 8, "height": 6} for i in image_ids]
    for image in images:
        write_image(root / split / image["file_name"], (image["id"] * 20 % 256, 0, 0))
    annotations = [
        {"id": 100 * i + j, "image_id": i, "caption": f"Image {i} caption {j}. "}
        for j in range(captions_per_image)
        for i in image_ids
    ]
    data = {"info": {}, "images": images, "annotations": annotations}
    write_json(root / "annotations" / f"captions_{split}.json", data)
    return data


KARPATHY = [("train", 11), ("restval", 12), ("val", 13), ("test", 14), ("train", 15)]


@pytest.fixture
def coco_root(tmp_path) -> Path:
    """Official files for train2014 (20 images) and val2014 (4), and a Karpathy split of 5 images."""
    official_file(tmp_path, "train2014", list(range(1, 21)))
    official_file(tmp_path, "val2014", [11, 12, 13, 14])
    entries = [
        {
            "filepath": "val2014",
            "filename": f"COCO_val2014_{cocoid:012d}.jpg",
            "split": split,
            "cocoid": cocoid,
            "sentences": [{"raw": f"Photo {cocoid}, take {j}.", "tokens": []} for j in range(3)],
        }
        for split, cocoid in KARPATHY
    ]
    write_image(tmp_path / "val2014" / "COCO_val2014_000000000015.jpg", (0, 200, 0))
    write_json(tmp_path / "dataset_coco.json", {"images": entries, "dataset": "coco"})
    return tmp_path


def test_coco_captions_are_grouped_by_image_in_the_order_of_images(coco_root):
    path = coco_root / "annotations" / "captions_val2014.json"
    data = json.loads(path.read_text())
    data["images"].append({"id": 99, "file_name": "COCO_val2014_000000000099.jpg"})  # no caption: left out
    write_json(path, data)
    records = load_coco_captions(path, coco_root / "val2014")
    assert [r.image_id for r in records] == ["11", "12", "13", "14"]
    assert records[1].captions == ["Image 12 caption 0.", "Image 12 caption 1."]
    assert records[1].image == str(coco_root / "val2014" / "COCO_val2014_000000000012.jpg")


def test_official_coco_splits_hold_out_validation_images_from_training(coco_root):
    data = CocoCaptionsDataModule(str(coco_root), image_size=SIZE, batch_size=3, val_fraction=0.25)
    train, val, test = (data.records(split) for split in ("train", "val", "test"))
    assert (len(train), len(val)) == (15, 5)
    assert {r.image_id for r in train} | {r.image_id for r in val} == {str(i) for i in range(1, 21)}
    assert [r.image_id for r in test] == ["11", "12", "13", "14"]
    batch = next(iter(data.test_dataloader()))
    assert batch["pixel_values"].shape == (3, 3, SIZE, SIZE)
    assert batch["references"][0] == ["Image 11 caption 0.", "Image 11 caption 1."]
    assert batch["captions"] == [refs[0] for refs in batch["references"]]
    assert batch["scenes"] is None
    assert data.train_captions[:2] == train[0].captions


def test_karpathy_splits_put_restval_in_training(coco_root):
    data = CocoCaptionsDataModule(str(coco_root), karpathy_split="dataset_coco.json", image_size=SIZE)
    assert [r.image_id for r in data.records("train")] == ["11", "15", "12"]
    assert [r.image_id for r in data.records("val")] == ["13"]
    assert [r.image_id for r in data.records("test")] == ["14"]
    assert data.records("val")[0].captions == [f"Photo 13, take {j}." for j in range(3)]


# ------------------------------------------------------------------------------------ bad input


def rewrite(path: Path, change) -> Path:
    data = json.loads(path.read_text())
    change(data)
    return write_json(path, data)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["annotations"][1].pop("caption"), r"annotations\[1\]: 'caption' must be a non-empty str, got None"),
        (lambda d: d["annotations"][2].update(image_id=77), r"annotations\[2\]: image_id 77 is not in the file's images"),
        (lambda d: d["images"][3].update(id=11), r"images\[3\]: image id 11 is listed twice"),
        (lambda d: d["images"][0].update(id="11"), r"images\[0\]: 'id' must be a non-empty int, got '11'"),
        (lambda d: d.pop("annotations"), r"expected a JSON object with a list under 'annotations'"),
    ],
)
def test_bad_coco_caption_entries_name_the_file_and_entry(coco_root, change, message):
    path = rewrite(coco_root / "annotations" / "captions_val2014.json", change)
    with pytest.raises(CaptionFormatError, match=f"^{path}: {message}"):
        load_coco_captions(path, coco_root / "val2014")


def test_a_missing_coco_image_names_the_file_and_its_entry(coco_root):
    (coco_root / "val2014" / "COCO_val2014_000000000013.jpg").unlink()
    path = coco_root / "annotations" / "captions_val2014.json"
    with pytest.raises(FileNotFoundError, match=rf"^{path}: images\[2\]: image file not found: .*000000000013.jpg"):
        load_coco_captions(path, coco_root / "val2014")


def test_a_caption_file_that_is_not_json_names_the_line(tmp_path):
    path = tmp_path / "captions.json"
    path.write_text('{"images": [],\n "annotations": [,]}')
    with pytest.raises(CaptionFormatError, match=rf"^{path}:2:18: not valid JSON"):
        load_coco_captions(path, tmp_path)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["images"][2].update(split="dev"), r"images\[2\]: unknown split 'dev' \(expected one of train, "),
        (lambda d: d["images"][1].update(sentences=[]), r"images\[1\]: 'sentences' is empty"),
        (lambda d: d["images"][1]["sentences"][2].pop("raw"), r"images\[1\], sentences\[2\]: 'raw' must be a non-empty"),
        (lambda d: d["images"][4].pop("filepath"), r"images\[4\]: 'filepath' must be a non-empty str"),
    ],
)
def test_bad_karpathy_entries_name_the_file_and_entry(coco_root, change, message):
    path = rewrite(coco_root / "dataset_coco.json", change)
    with pytest.raises(CaptionFormatError, match=f"^{path}: {message}"):
        load_karpathy_split(path, coco_root)
