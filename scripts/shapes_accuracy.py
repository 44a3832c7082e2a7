"""Accuracy of a saved model on the released SHAPES val split, overall and by question depth.

Depth is the number of relation words (left_of, right_of, above, below) in the query. Published
test accuracies for comparison (SHAPES README): majority 63.0, VIS+LSTM 65.3, NMN 90.6, N2NMN 96.2.

    .venv/bin/python scripts/shapes_accuracy.py --model runs/shapes/latest/model
    .venv/bin/python scripts/shapes_accuracy.py --model runs/shapes/latest/model --by-question  # each of the 16 val questions
"""

from __future__ import annotations

import argparse

from _common import add_model_argument, load_model

from vlfuse.analysis.grouped_accuracy import accuracy_by_group, accuracy_table
from vlfuse.data.shapes import query_depth
from vlfuse.datamodules import ShapesDataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser)
    parser.add_argument("--data-dir", default=None, help="the released SHAPES files (default: see ShapesDataModule)")
    parser.add_argument("--by-question", action="store_true", help="one row per val question instead of per depth")
    args = parser.parse_args()

    model = load_model(args.model)
    data = ShapesDataModule(data_dir=args.data_dir, image_size=model.config.image.image_size, batch_size=128)
    queries = data.queries("val")
    if args.by_question:
        groups, header = [f"{query_depth(q)}: {q}" for q in queries], "depth: question"
    else:
        groups, header = [query_depth(q) for q in queries], "question depth (relations)"
    correct, total = accuracy_by_group(model, data.val_dataloader(), lambda row, question: groups[row])
    print(accuracy_table(correct, total, group=header, accuracy="val accuracy"))


if __name__ == "__main__":
    main()
