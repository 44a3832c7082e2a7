"""Tabulate SHAPES runs over seeds from their training logs: no model is loaded, no test split read.

Each run is a ``vlfuse fit --config configs/shapes_fusion.yaml`` folder whose ``metrics.csv`` holds
``val/acc`` and the per-pattern val accuracy the config logs (``val_group/is C1 R1 R1 C1``, ...;
:func:`vlfuse.data.shapes.question_pattern`). For each run: the best val accuracy and its epoch (the
saved model), the last epoch's, the first epoch above the take-off line, val after epoch 8, val by
question depth (relations) and the double move (``is C1 R1 R1 C1``) at the best epoch; then the
median and the worst over the runs.

    .venv/bin/python scripts/shapes_seeds_table.py runs/shapes_fusion_s0 runs/shapes_fusion_s1
"""

from __future__ import annotations

import argparse
import csv
import statistics
from collections import Counter
from pathlib import Path

from vlfuse.analysis.tables import markdown_table
from vlfuse.data.shapes import question_pattern, read_questions
from vlfuse.datamodules.shapes import find_shapes_dir

TAKE_OFF = 0.70
"""Val accuracy above which a run has left the answer prior (the majority answer is 61.5%)."""
DOUBLE_MOVE = "is C1 R1 R1 C1"
"""The pattern of ``(is green (right_of (right_of green)))``: one relation twice, from and to one colour."""


def epochs_of(run: Path) -> list[dict[str, float]]:
    """The validation rows of a run's ``metrics.csv`` (the newest version's), in epoch order."""
    logs = sorted(run.glob("**/metrics.csv"), key=lambda path: path.stat().st_mtime)
    if not logs:
        raise SystemExit(f"{run}: no metrics.csv under it (is it a vlfuse fit folder?)")
    with logs[-1].open() as file:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(file)]
    rows = [row for row in rows if "val/acc" in row]
    if not rows:
        raise SystemExit(f"{logs[-1]}: no val/acc rows")
    return sorted(rows, key=lambda row: row["epoch"])


def depth_accuracy(row: dict[str, float], counts: Counter) -> dict[int, float]:
    """Val accuracy by depth (relations in the pattern), weighting each pattern by its questions."""
    correct, total = Counter(), Counter()
    for pattern, n in counts.items():
        key = f"val_group/{pattern}"
        if key in row:
            depth = sum(word.startswith("R") for word in pattern.split())
            correct[depth] += row[key] * n
            total[depth] += n
    return {depth: correct[depth] / total[depth] for depth in sorted(total)}


def summarise(run: Path, counts: Counter) -> dict[str, object]:
    rows = epochs_of(run)
    best = max(rows, key=lambda row: row["val/acc"])  # the first of equal bests, as the checkpoint keeps it
    took_off = next((int(row["epoch"]) + 1 for row in rows if row["val/acc"] > TAKE_OFF), None)
    after_8 = next((row["val/acc"] for row in rows if int(row["epoch"]) + 1 == 8), None)
    return {
        "run": f"{run.parent.name}/{run.resolve().name}" if run.name == "latest" else run.name, "best": best["val/acc"], "best epoch": int(best["epoch"]) + 1, "last": rows[-1]["val/acc"],
        "epochs": len(rows), "took off": took_off, "after 8": after_8,
        "depth": depth_accuracy(best, counts), "double move": best.get(f"val_group/{DOUBLE_MOVE}"),
    }


def over(values: list, pick):
    """``pick`` (median, min) of the values that were measured, else None."""
    values = [value for value in values if value is not None]
    return pick(values) if values else None


def percent(value) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def table(summaries: list[dict[str, object]]) -> str:
    rows = []
    for s in summaries:
        depth = " / ".join(percent(v) for v in s["depth"].values())
        rows.append([s["run"], f"{percent(s['best'])} ({s['best epoch']})", percent(s["last"]), depth,
                     percent(s["double move"]), percent(s["after 8"]), s["took off"] or f"not in {s['epochs']}"])
    for name, pick in (("median", statistics.median), ("worst", min)):
        depths = " / ".join(percent(over([s["depth"].get(d) for s in summaries], pick)) for d in summaries[0]["depth"])
        rows.append([f"**{name}**", percent(over([s["best"] for s in summaries], pick)),
                     percent(over([s["last"] for s in summaries], pick)), depths,
                     percent(over([s["double move"] for s in summaries], pick)),
                     percent(over([s["after 8"] for s in summaries], pick)), ""])
    header = ["run", "best val (epoch)", "last epoch", "depth 0 / 1 / 2 (best epoch)", "double move (best epoch)",
              "val after epoch 8", "took off (first epoch above 70%)"]
    return markdown_table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", type=Path, help="vlfuse fit output folders (trainer.default_root_dir)")
    parser.add_argument("--data-dir", default=None, help="the released SHAPES files (default: see ShapesDataModule)")
    args = parser.parse_args()
    counts = Counter(question_pattern(query) for query in read_questions(find_shapes_dir(args.data_dir), "val").queries)
    print(table([summarise(run, counts) for run in args.runs]))


if __name__ == "__main__":
    main()
