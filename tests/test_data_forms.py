"""The forms your own data may take (docs/datasets-imagefolder.md): split folders with a metadata.jsonl,
metadata.csv or metadata.parquet under any of their split names, and tables of rows (CSV, JSON,
JSON Lines) beside the images; each trains a step through the CLI, and each mistake is one line
before training starts."""

from __future__ import annotations

import csv
import json
import shutil
import sys
import types
from pathlib import Path

import easy_vqa
import pytest

from vlfuse.cli import main

from conftest import REPO, tiny_cli_args

CONFIG = str(REPO / "configs" / "imagefolder_vqa.yaml")
ONE_STEP = [
    "--trainer.max_epochs=1",
    "--trainer.limit_train_batches=1",
    "--trainer.num_sanity_val_steps=0",
    "--trainer.limit_val_batches=1",
    "--trainer.limit_test_batches=1",
]


def easy_rows(images: range) -> list[tuple[str, str, str]]:
    """``(image path, question, answer)`` of easy-VQA's test questions about ``images`` (indices)."""
    questions, answers, image_ids = easy_vqa.get_test_questions()
    paths = easy_vqa.get_test_image_paths()
    return [(paths[i], q, a) for q, a, i in zip(questions, answers, image_ids) if i in images]


def write_images(folder: Path, rows: list[tuple[str, str, str]], prefix: str = "") -> list[dict]:
    """Copy the rows' images into ``folder`` (as ``prefix`` + their name); the rows as dicts with
    ``file_name``, ``question`` and ``answer``."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for path, question, answer in rows:
        name = prefix + Path(path).name
        if not (folder / name).exists():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, folder / name)
        out.append({"file_name": name, "question": question, "answer": answer})
    return out


def write_table(path: Path, rows: list[dict]) -> Path:
    """``rows`` as a CSV, JSON (a list) or JSON Lines file, by the suffix of ``path``."""
    if path.suffix == ".csv":
        with path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


SPLIT_IMAGES = {"train": range(0, 4), "validation": range(4, 6), "test": range(6, 8)}


def imagefolder(root: Path, metadata: str = "metadata.jsonl", folders: dict[str, str] | None = None) -> Path:
    """``root/{train,validation,test}/`` (or ``folders``' names for them) with easy-VQA images and a ``metadata`` file."""
    for split, images in SPLIT_IMAGES.items():
        folder = root / (folders or {}).get(split, split)
        write_table(folder / metadata, write_images(folder, easy_rows(images)))
    return root


def fit(tmp_path: Path, *data_args: str) -> int:
    """``vlfuse fit`` of the imagefolder config, shrunk to a step, on ``data_args``."""
    return main(["fit", "--config", CONFIG, *data_args, *tiny_cli_args(tmp_path / "run"), *ONE_STEP])


def trained(tmp_path: Path, capsys, *data_args: str) -> str:
    """Fit a step on ``data_args``; what it printed (it tested after fitting)."""
    assert fit(tmp_path, *data_args) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "vlfuse: test accuracy" in out
    assert (tmp_path / "run" / "model" / "answers.json").exists()
    return out


def refused(tmp_path: Path, capsys, *data_args: str) -> str:
    """Fit on ``data_args``, which must fail: the one error line (``vlfuse: error: `` left off), nothing trained."""
    assert fit(tmp_path, *data_args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("vlfuse: error: ")
    assert not (tmp_path / "run" / "checkpoints").exists()  # stopped before the first step
    return err[-1].removeprefix("vlfuse: error: ")


# ------------------------------------------------------------------------------ forms that train
def test_split_folders_with_metadata_csv_under_other_split_names(tmp_path, capsys):
    data = imagefolder(tmp_path / "data", "metadata.csv", {"validation": "val", "test": "testing"})
    trained(tmp_path, capsys, "--data.init_args.data_dir", str(data))


def test_split_folders_with_metadata_parquet(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    for split, images in SPLIT_IMAGES.items():
        rows = write_images(tmp_path / "data" / split, easy_rows(images))
        pq.write_table(pa.Table.from_pylist(rows), tmp_path / "data" / split / "metadata.parquet")
    trained(tmp_path, capsys, "--data.init_args.data_dir", str(tmp_path / "data"))


def renamed(rows: list[dict]) -> list[dict]:
    """The rows with the columns ``img``, ``q`` and ``a``."""
    return [{"img": row["file_name"], "q": row["question"], "a": row["answer"]} for row in rows]


@pytest.mark.parametrize("suffix", [".csv", ".json", ".jsonl"])
def test_one_table_beside_images_with_columns_named_otherwise(tmp_path, capsys, suffix):
    rows = write_images(tmp_path / "mine", easy_rows(range(10)), prefix="images/")
    table = write_table(tmp_path / "mine" / f"data{suffix}", renamed(rows))
    trained(
        tmp_path, capsys, "--data.init_args.data_dir", "null", "--data.init_args.data_files", str(table),
        "--data.init_args.columns.image", "img", "--data.init_args.columns.question", "q",
        "--data.init_args.columns.answer", "a",
    )  # fmt: skip


def test_a_table_per_split_with_human_answers_in_a_csv(tmp_path, capsys):
    folder = tmp_path / "mine"
    files = {}
    for split, suffix in (("train", ".csv"), ("validation", ".json"), ("test", ".jsonl")):
        rows = write_images(folder, easy_rows(SPLIT_IMAGES[split]), prefix="images/")
        if split == "train":  # a CSV cell holds a list as JSON
            rows = [{**row, "answer": "", "answers": json.dumps([row["answer"]] * 3)} for row in rows]
        files[split] = str(write_table(folder / f"{split}{suffix}", rows))
    trained(tmp_path, capsys, "--data.init_args.data_dir", "null", "--data.init_args.data_files", json.dumps(files))


# ------------------------------------------------------------------------------ mistakes, in one line
def test_a_missing_test_split_stops_before_training_when_the_fit_tests_after(tmp_path, capsys):
    data = imagefolder(tmp_path / "mydata")
    shutil.rmtree(data / "test")
    assert refused(tmp_path, capsys, "--data.init_args.data_dir", str(data)) == (
        f"{data} has no test split: looked for test/, testing/; found train/, validation/"
    )
    assert not (tmp_path / "run" / "version_0").exists()  # the run folder claimed is given back
    assert fit(tmp_path, "--data.init_args.data_dir", str(data), "--test_after_fit=false") == 0


def test_a_missing_validation_split_names_every_name_looked_for(tmp_path, capsys):
    data = imagefolder(tmp_path / "mydata")
    shutil.rmtree(data / "validation")
    assert refused(tmp_path, capsys, "--data.init_args.data_dir", str(data)) == (
        f"{data} has no validation split: looked for validation/, val/, valid/, dev/; found test/, train/"
    )


def test_two_names_of_one_split(tmp_path, capsys):
    data = imagefolder(tmp_path / "mydata")
    shutil.copytree(data / "validation", data / "dev")
    assert refused(tmp_path, capsys, "--data.init_args.data_dir", str(data)) == (
        f"{data} has 2 validation splits, validation/ and dev/: keep one"
    )


def test_two_metadata_files_in_a_split_folder(tmp_path, capsys):
    data = imagefolder(tmp_path / "mydata")
    write_table(data / "train" / "metadata.csv", [{"file_name": "x.png", "question": "q?", "answer": "a"}])
    assert refused(tmp_path, capsys, "--data.init_args.data_dir", str(data)) == (
        f"{data / 'train'} has metadata.jsonl and metadata.csv: keep one metadata file per split"
    )


def test_a_split_folder_without_metadata(tmp_path, capsys):
    data = imagefolder(tmp_path / "mydata")
    (data / "test" / "metadata.jsonl").unlink()
    assert refused(tmp_path, capsys, "--data.init_args.data_dir", str(data)) == (
        f"{data / 'test'} has no metadata file: looked for metadata.jsonl, metadata.csv, metadata.parquet "
        "(an imagefolder split is a folder of images with one)"
    )


def test_metadata_parquet_without_pyarrow(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # "import pyarrow.parquet" now raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    data = imagefolder(tmp_path / "mydata")
    (data / "train" / "metadata.jsonl").rename(data / "train" / "metadata.parquet")
    assert refused(tmp_path, capsys, "--data.init_args.data_dir", str(data)) == (
        f"{data / 'train' / 'metadata.parquet'}: reading a Parquet file needs the 'pyarrow' package: pip install pyarrow"
    )


@pytest.fixture
def table(tmp_path) -> Path:
    """``mine/data.csv`` with the columns img, q, a, its images in ``mine/images/``."""
    rows = write_images(tmp_path / "mine", easy_rows(range(10)), prefix="images/")
    return write_table(tmp_path / "mine" / "data.csv", renamed(rows))


COLUMNS = '{"image": "img", "question": "q", "answer": "a"}'
"""The columns of :func:`table`."""


def from_table(path: Path | str, *more: str) -> list[str]:
    return ["--data.init_args.data_dir", "null", "--data.init_args.data_files", str(path), *more]


def test_a_table_without_a_column_says_which_columns_it_has(tmp_path, capsys, table):
    assert refused(tmp_path, capsys, *from_table(table, "--data.init_args.columns.image", "img")) == (
        f"{table}: no column 'question' (columns: img, q, a); set --data.init_args.columns.question q"
    )


def test_a_json_row_without_a_field_says_what_the_row_has(tmp_path, capsys, table):
    rows = [{"img": "images/x.png", "q": "what?", "a": "red"}]
    path = write_table(table.parent / "data.json", rows)
    assert refused(tmp_path, capsys, *from_table(path, "--data.init_args.columns.image", "img")) == (
        f"{path} row 0: no 'question' (a non-empty string); the row has img, q, a; set --data.init_args.columns.question q"
    )


def test_a_csv_row_with_more_cells_than_the_header(tmp_path, capsys, table):
    with table.open("a") as f:
        f.write("images/x.png,what?,red,extra\n")
    lines = len(table.read_text().splitlines())
    assert refused(tmp_path, capsys, *from_table(table, "--data.init_args.columns", COLUMNS)) == (
        f"{table}:{lines}: 4 cells, but the header names 3 columns (img, q, a)"
    )


def test_a_csv_answers_cell_that_is_not_a_json_list(tmp_path, capsys, table):
    path = write_table(table.parent / "answers.csv", [{"file_name": "images/x.png", "question": "what?", "answers": "red;blue"}])
    assert refused(tmp_path, capsys, *from_table(path)) == (
        f"""{path}:2: 'answers' must be a non-empty list of answers (in a CSV cell, a JSON list: ["red", "dark red"]); got 'red;blue'"""
    )


def test_an_image_path_outside_the_tables_folder(tmp_path, capsys, table):
    path = write_table(table.parent / "out.csv", [{"file_name": "../x.png", "question": "what?", "answer": "red"}])
    assert refused(tmp_path, capsys, *from_table(path)) == (
        f"{path}:2: file_name '../x.png' is outside {path.parent}, the folder of out.csv (allow_outside_paths reads it)"
    )


def test_too_few_images_to_hold_out_validation_and_test(tmp_path, capsys):
    rows = write_images(tmp_path / "mine", easy_rows(range(2)))
    path = write_table(tmp_path / "mine" / "data.jsonl", rows)
    assert refused(tmp_path, capsys, *from_table(path)) == (
        f"{path} has 2 images: too few to hold out 1 for validation and 1 for test and train on the rest; "
        "give a table per split (data_files: {train: ..., validation: ..., test: ...})"
    )


def test_a_table_per_split_without_the_test_split(tmp_path, capsys, table):
    files = json.dumps({"train": str(table), "val": str(table)})
    assert refused(tmp_path, capsys, *from_table(files, "--data.init_args.columns", COLUMNS)) == (
        "data_files has no test split: looked for test, testing; found train, val"
    )


def test_a_table_per_split_with_an_unknown_split(tmp_path, capsys, table):
    files = json.dumps({"train": str(table), "eval": str(table)})
    assert refused(tmp_path, capsys, *from_table(files, "--data.init_args.columns", COLUMNS)) == (
        "data_files: unknown split 'eval'; the splits are train, validation, val, valid, dev, test, testing"
    )


def test_a_table_given_as_a_datasets_dataset(tmp_path, capsys, table):
    args = ["--data.init_args.data_dir", "null", "--data.init_args.dataset"]
    assert refused(tmp_path, capsys, *args, str(table)) == (
        f"data.init_args.dataset {str(table)!r} is a file: give a table of rows (a .jsonl, .json, .csv, .parquet file) "
        "as data.init_args.data_files (a folder of split folders as data.init_args.data_dir)"
    )
    assert refused(tmp_path, capsys, *args, "csv", "--data.init_args.dataset_config", str(table)) == (
        "data.init_args.dataset 'csv' is the name of one of datasets' loaders: give a table of rows "
        "(a .jsonl, .json, .csv, .parquet file) as data.init_args.data_files (a folder of split folders as data.init_args.data_dir)"
    )


def test_a_folder_and_a_table_at_once(tmp_path, capsys, table):
    assert refused(tmp_path, capsys, "--data.init_args.data_files", str(table)) == (
        "give one of data.init_args.data_dir (a folder of split folders), data.init_args.data_files (a table of rows, "
        "or a table per split) or data.init_args.dataset (a datasets name): data_dir and data_files are set "
        "(unset one: --data.init_args.data_dir null)"
    )


def test_a_datasets_dataset_without_a_column_says_which_columns_it_has(tmp_path, capsys, monkeypatch):
    class Rows(list):
        column_names = ["img", "q", "a"]
        features: dict = {}

    fake = types.SimpleNamespace(load_dataset=lambda name, config, split: Rows(), Image=type("Image", (), {}))
    monkeypatch.setitem(sys.modules, "datasets", fake)
    args = ["--data.init_args.data_dir", "null", "--data.init_args.dataset", "user/vqa"]
    assert refused(tmp_path, capsys, *args) == (
        "user/vqa [train]: no column 'image' (columns: img, q, a); set --data.init_args.columns.image img"
    )


def test_a_data_dir_that_is_not_there(tmp_path, capsys):
    assert refused(tmp_path, capsys, "--data.init_args.data_dir", str(tmp_path / "nowhere")) == (
        f"{tmp_path / 'nowhere'} not found: data_dir is the folder holding train/, validation/ and test/"
    )
