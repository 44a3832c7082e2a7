"""scripts/stress_imagefolder.py: a large imagefolder read as `vlfuse fit` reads it (the slow test at
the issue's size, 200,000 rows over 20,000 images; the fast one at a few rows)."""

import re

import pytest

from conftest import load_script


def run(tmp_path, capsys, rows: int, images: int) -> str:
    load_script("stress_imagefolder").main(["--data", str(tmp_path / "data"), "--rows", str(rows), "--images", str(images)])
    return capsys.readouterr().out


def check_report(out: str, tmp_path, rows: int, images: int) -> None:
    assert re.search(rf"check: {rows:,} rows, {images:,} images in [\d.]+ s", out), out
    assert re.search(rf"epoch: {images:,} images in [\d.]+ s", out), out
    # the bad row appended at the end is named by file and line, before any training
    metadata = tmp_path / "data_bad_row" / "train" / "metadata.jsonl"
    assert f"bad row: {metadata}:{rows + 1}: image file not found: " in out


def test_a_small_stress_dataset_is_checked_read_and_its_bad_row_named(tmp_path, capsys):
    check_report(run(tmp_path, capsys, 40, 8), tmp_path, 40, 8)


@pytest.mark.slow
def test_two_hundred_thousand_rows_over_twenty_thousand_images(tmp_path, capsys):
    check_report(run(tmp_path, capsys, 200_000, 20_000), tmp_path, 200_000, 20_000)
