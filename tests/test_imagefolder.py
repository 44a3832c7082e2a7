"""Data in the Hugging Face imagefolder layout: reading, grouping, bad rows, and fit -> predict."""

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

from vlfuse.cli import main
from vlfuse.data.imagefolder import BadRowError, load_hub_split, load_imagefolder_split, records_from_rows
from vlfuse.datamodules import ImageFolderDataModule

from conftest import REPO, tiny_cli_args

COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 30)}


def write_split(folder: Path, rows: list, images: dict[str, str]) -> Path:
    """``images``: file name -> colour; ``rows``: dicts (written as JSON) or raw lines."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, colour in images.items():
        Image.new("RGB", (20, 20), COLOURS[colour]).save(folder / name)
    lines = [row if isinstance(row, str) else json.dumps(row) for row in rows]
    (folder / "metadata.jsonl").write_text("\n".join(lines) + "\n", errors="surrogateescape")  # may hold raw bytes
    return folder / "metadata.jsonl"


def colour_rows(images: dict[str, str]) -> list[dict]:
    """Two questions per image, so every image is named by several rows."""
    rows = []
    for name, colour in images.items():
        rows.append({"file_name": name, "question": "what colour is it?", "answer": colour})
        rows.append({"file_name": name, "question": "is it red?", "answer": "yes" if colour == "red" else "no"})
    return rows


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """train/validation/test folders of PNG and JPEG images, each image asked two questions."""
    root = tmp_path / "DATA"
    splits = {
        "train": {"a.png": "red", "b.jpg": "blue", "c.png": "green", "d.jpg": "red", "e.png": "blue", "f.jpg": "green"},
        "validation": {"g.png": "red", "h.jpg": "blue"},
        "test": {"i.jpg": "green", "j.png": "red"},
    }
    for split, images in splits.items():
        write_split(root / split, colour_rows(images), images)
    return root


def test_rows_naming_one_image_become_one_record_in_file_order(data_dir):
    records = load_imagefolder_split(data_dir / "train").records
    assert [r.image_id for r in records] == ["a.png", "b.jpg", "c.png", "d.jpg", "e.png", "f.jpg"]
    assert records[1].image == str(data_dir / "train" / "b.jpg")
    assert records[1].questions == ["what colour is it?", "is it red?"]
    assert records[1].answers == ["blue", "no"]
    assert records[1].human_answers == []


def test_a_batch_encodes_each_image_once_for_all_its_questions(data_dir):
    dm = ImageFolderDataModule(data_dir=str(data_dir), batch_size=3, image_size=16)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["pixel_values"].shape == (3, 3, 16, 16)
    assert len(batch["questions"]) == 6
    assert batch["image_index"].tolist() == [0, 0, 1, 1, 2, 2]
    assert "human_labels" not in batch
    assert dm.answers == ["no", "blue", "green", "red", "yes"]  # by frequency in train, then alphabetically


def test_human_answers_are_normalised_and_their_majority_is_the_label(tmp_path):
    rows = [
        {"file_name": "a.png", "question": "what colour?", "answers": ["Red", "red", "blue", "red."]},
        {"file_name": "a.png", "question": "how many?", "answer": "2"},
    ]
    write_split(tmp_path, rows, {"a.png": "red"})
    (record,) = load_imagefolder_split(tmp_path).records
    assert record.answers == ["red", "2"]
    # a single answer counts as one human's when the split has human answers
    assert record.human_answers == [["red", "red", "blue", "red"], ["2"]]


def test_human_answers_reach_the_batch(tmp_path):
    images = {"a.png": "red", "b.png": "blue"}
    rows = [{"file_name": n, "question": "colour?", "answers": [c] * 3 + ["green"]} for n, c in images.items()]
    for split in ("train", "validation"):
        write_split(tmp_path / split, rows, images)
    dm = ImageFolderDataModule(data_dir=str(tmp_path), batch_size=2, image_size=8)
    batch = next(iter(dm.val_dataloader()))
    red, blue = dm.vocab.index("red"), dm.vocab.index("blue")
    assert batch["human_labels"].tolist() == [[red] * 3 + [-100], [blue] * 3 + [-100]]  # green is not a class


# ----------------------------------------------------------------------------------- bad rows

BAD_ROWS = {
    "malformed JSON": ('{"file_name": "a.png", "question": "q?" "answer": "x"}', r"not valid JSON: Expecting ',' delimiter \(column 41\)$"),
    "nested too deep": ("[" * 100_000 + "]" * 100_000, r"not usable JSON: nested too deep$"),
    "integer of 5000 digits": ('{"file_name": "a.png", "question": "q?", "answer": "x", "n": ' + "1" * 5000 + "}",
                               r"not usable JSON: an integer of more than 4300 digits$"),
    "NaN": ('{"file_name": "a.png", "question": "q?", "answer": NaN}', r"NaN is not a JSON value$"),
    "not UTF-8": ('{"file_name": "a.png", "question": "caf\udce9?", "answer": "x"}', r"not UTF-8 text"),
    "no question": ({"file_name": "a.png", "answer": "x"}, r"no 'question'"),
    "empty question": ({"file_name": "a.png", "question": " ", "answer": "x"}, r"no 'question'"),
    "no answer": ({"file_name": "a.png", "question": "q?"}, r"no 'answer' \(a string\) or 'answers' \(a list\)"),
    "answers not a list": ({"file_name": "a.png", "question": "q?", "answers": "x"}, r"'answers' must be a non-empty list"),
    "no file_name": ({"question": "q?", "answer": "x"}, r"no 'file_name'"),
    "not an object": ('["a.png", "q?", "x"]', r"expected a JSON object, got list"),
    "missing image": ({"file_name": "gone.png", "question": "q?", "answer": "x"}, r"image file not found: .*gone\.png"),
    "unreadable image": ({"file_name": "broken.jpg", "question": "q?", "answer": "x"}, r"cannot read image .*broken\.jpg"),
    "truncated image": ({"file_name": "cut.png", "question": "q?", "answer": "x"}, r"cannot read image .*cut\.png"),
}


def split_with_bad_row(folder: Path, bad_row) -> Path:
    """Two good rows, the bad row on line 3, one more good row; a broken and a truncated image."""
    good = {"file_name": "a.png", "question": "colour?", "answer": "red"}
    metadata = write_split(folder, [good, good, bad_row, good], {"a.png": "red"})
    (folder / "broken.jpg").write_bytes(b"not an image at all")
    png = io.BytesIO()
    Image.new("RGB", (64, 64), (1, 2, 3)).save(png, format="PNG")
    (folder / "cut.png").write_bytes(png.getvalue()[:60])
    return metadata


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_row_stops_loading_with_one_line_naming_file_and_line(tmp_path, case):
    bad_row, message = BAD_ROWS[case]
    metadata = split_with_bad_row(tmp_path, bad_row)
    with pytest.raises(BadRowError, match=rf"^{metadata}:3: {message}") as error:
        load_imagefolder_split(tmp_path)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_skip_bad_rows_leaves_the_row_out_and_counts_it(tmp_path, case):
    split_with_bad_row(tmp_path, BAD_ROWS[case][0])
    loaded = load_imagefolder_split(tmp_path, skip_bad_rows=True)
    assert loaded.skipped == 1
    assert [len(r.questions) for r in loaded.records] == [3]


def test_datamodule_checks_every_split_in_setup_and_prints_skip_counts(data_dir, capsys):
    with (data_dir / "test" / "metadata.jsonl").open("a") as f:
        f.write('{"file_name": "i.jpg"}\n{"file_name": "nope.png", "question": "q?", "answer": "x"}\n')
    metadata = data_dir / "test" / "metadata.jsonl"
    with pytest.raises(BadRowError, match=rf"^{metadata}:5: no 'question'"):
        ImageFolderDataModule(data_dir=str(data_dir)).setup("fit")  # the test split too, before training
    dm = ImageFolderDataModule(data_dir=str(data_dir), skip_bad_rows=True)
    dm.setup("fit")
    assert "vlfuse: skipped 2 bad rows of the test split" in capsys.readouterr().err
    assert len(dm.records("test")) == 2


def test_datamodule_names_a_missing_split_and_bad_arguments(data_dir):
    with pytest.raises(FileNotFoundError, match=r"train has no validation split: looked for validation/, val/"):
        ImageFolderDataModule(data_dir=str(data_dir / "train")).records("val")
    with pytest.raises(ValueError, match="one of data.init_args.data_dir"):
        ImageFolderDataModule()
    with pytest.raises(ValueError, match=r"columns: unknown keys \['img'\]"):
        ImageFolderDataModule(data_dir=str(data_dir), columns={"img": "image"})
    assert ImageFolderDataModule(data_dir=str(data_dir), top_k_answers=2).vocab.answers == ["no", "blue"]


# --------------------------------------------------------------------------------- datasets


def png_bytes(colour: str) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), COLOURS[colour]).save(out, format="PNG")
    return out.getvalue()


def test_rows_of_a_datasets_dataset_are_mapped_grouped_and_checked():
    red = {"bytes": png_bytes("red"), "path": None}
    rows = [
        {"img": red, "q": "colour?", "a": "red"},
        {"img": dict(red), "q": "shape?", "a": "square"},  # the same image bytes: the same record
        {"img": {"bytes": png_bytes("blue"), "path": "blue.png"}, "q": "colour?", "a": "blue"},
        {"img": {"bytes": b"garbage", "path": None}, "q": "colour?", "a": "red"},
    ]
    columns = {"image": "img", "question": "q", "answer": "a"}
    with pytest.raises(BadRowError, match=r"^user/vqa \[train\] row 3: cannot read"):
        records_from_rows(rows, columns, source="user/vqa [train]")
    loaded = records_from_rows(rows, columns, skip_bad_rows=True)
    assert loaded.skipped == 1
    assert [r.questions for r in loaded.records] == [["colour?", "shape?"], ["colour?"]]
    assert loaded.records[0].image.getpixel((0, 0)) == COLOURS["red"]
    with pytest.raises(ValueError, match=r"unknown keys \['picture'\]"):
        records_from_rows(rows, {"picture": "img"})


def test_datasets_dataset_without_the_package_names_pip_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # "import datasets" now raises ImportError
    with pytest.raises(ValueError, match=r"^reading the datasets dataset 'user/vqa' needs .*: pip install datasets$"):
        load_hub_split("user/vqa", "train")


# ------------------------------------------------------------------------------- end to end


def test_fit_on_a_folder_exports_a_model_that_predict_loads(data_dir, tmp_path, capsys):
    run = tmp_path / "run"
    args = [
        "fit", "--config", str(REPO / "configs" / "imagefolder_vqa.yaml"),
        "--data.init_args.data_dir", str(data_dir),
        *tiny_cli_args(run), "--trainer.max_epochs=1",
    ]  # fmt: skip
    assert main(args) == 0
    assert "test accuracy" in capsys.readouterr().out  # the config tests after fit
    predicted = subprocess.run(
        [sys.executable, "-m", "vlfuse.cli", "predict", "--model", str(run / "model"),
         "--image", str(data_dir / "test" / "i.jpg"), "--question", "what colour is it?"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert predicted.returncode == 0, predicted.stderr
    assert predicted.stdout.split()  # an answer
    answers = json.loads((run / "model" / "answers.json").read_text())
    assert any(answer in predicted.stdout for answer in answers)
