"""scripts/shapes_seeds_table.py: SHAPES runs over seeds, tabulated from their training logs."""

import csv
from collections import Counter

import pytest

from conftest import load_script

seeds = load_script("shapes_seeds_table")
COUNTS = Counter({"is C1 C2": 128, "is C1 R1 C2": 192, "is C1 R1 R1 C1": 64})


def write_run(root, vals, groups):
    """A run folder whose metrics.csv holds a training row and a validation row per epoch, as Lightning's CSVLogger writes."""
    log = root / "version_0" / "metrics.csv"
    log.parent.mkdir(parents=True)
    names = ["epoch", "step", "train/acc", "val/acc"] + [f"val_group/{p}" for p in COUNTS]
    with log.open("w", newline="") as file:
        writer = csv.DictWriter(file, names)
        writer.writeheader()
        for epoch, (val, group) in enumerate(zip(vals, groups)):
            writer.writerow({"epoch": epoch, "step": 10 * epoch, "train/acc": 0.5})
            writer.writerow({"epoch": epoch, "step": 10 * epoch, "val/acc": val,
                             **{f"val_group/{p}": a for p, a in zip(COUNTS, group)}})
    return root


def test_a_run_is_summarised_at_its_best_epoch_with_depths_weighted_by_questions(tmp_path):
    vals = [0.6, 0.65, 0.72, 0.9, 0.9, 0.8, 0.85, 0.88]
    groups = [(0.5, 0.5, 0.5)] * 3 + [(1.0, 0.9, 0.25), (1.0, 1.0, 0.0)] + [(0.5, 0.5, 0.5)] * 3
    summary = seeds.summarise(write_run(tmp_path / "s0", vals, groups), COUNTS)
    assert summary["best"] == 0.9 and summary["best epoch"] == 4  # the first of two equal bests
    assert summary["took off"] == 3 and summary["after 8"] == 0.88 and summary["last"] == 0.88
    assert summary["depth"] == {0: 1.0, 1: 0.9, 2: 0.25} and summary["double move"] == 0.25


def test_the_table_gives_every_run_then_the_median_and_the_worst(tmp_path):
    stalled = write_run(tmp_path / "stalled", [0.6, 0.62, 0.61], [(0.5, 0.6, 0.7)] * 3)
    good = write_run(tmp_path / "good", [0.6, 0.99, 1.0], [(0.5, 0.6, 0.7), (1, 0.99, 1), (1, 1, 1)])
    text = seeds.table([seeds.summarise(run, COUNTS) for run in (stalled, good)])
    lines = text.splitlines()
    assert lines[2].startswith("| stalled | 62.0% (2) |") and lines[2].endswith("| - | not in 3 |")
    assert lines[3].startswith("| good | 100.0% (3) |") and lines[3].endswith("| 2 |")
    assert lines[4].startswith("| **median** | 81.0% |") and lines[5].startswith("| **worst** | 62.0% |")


def test_a_folder_without_a_log_is_named(tmp_path):
    with pytest.raises(SystemExit, match="empty: no metrics.csv"):
        seeds.epochs_of(tmp_path / "empty")


def test_a_latest_link_is_named_by_its_run_folder_and_version(tmp_path):
    write_run(tmp_path / "shapes_fusion", [0.6, 0.9], [(1, 1, 1)] * 2)
    (tmp_path / "shapes_fusion" / "latest").symlink_to("version_0")
    assert seeds.summarise(tmp_path / "shapes_fusion" / "latest", COUNTS)["run"] == "shapes_fusion/version_0"
