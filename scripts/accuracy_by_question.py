"""Accuracy of a saved model on the easy-VQA test split, by kind of question.

Kinds: "what color ...?" / "what is the color of ...?", "what is the blue shape?" / "what shape
...?", and the yes/no questions,
split by whether they ask about a colour or a shape and whether they are negated ("not", "no").

    .venv/bin/python scripts/accuracy_by_question.py --model runs/easy_vqa/latest/model
"""

from __future__ import annotations

import argparse

from _common import add_model_argument, load_model

from vlfuse.analysis.grouped_accuracy import accuracy_by_group, accuracy_table
from vlfuse.data.easy_vqa import question_kind
from vlfuse.datamodules import EasyVQADataModule


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser)
    parser.add_argument("--limit-images", type=int, default=None, help="only the first N test images")
    args = parser.parse_args()

    model = load_model(args.model)
    data = EasyVQADataModule(image_size=model.config.image.image_size, batch_size=64, limit_images=args.limit_images)
    correct, total = accuracy_by_group(model, data.test_dataloader(), lambda row, question: question_kind(question))
    print(accuracy_table(correct, total, group="question kind", accuracy="accuracy", digits=2))


if __name__ == "__main__":
    main()
