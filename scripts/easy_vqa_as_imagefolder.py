"""Write easy-VQA as an imagefolder (docs/datasets-imagefolder.md), to test a model trained on
easy-VQA through ``configs/imagefolder_vqa.yaml`` (docs/results.md, "Your own data").

``test/`` holds every easy-VQA test image and question; ``train/`` and ``validation/`` hold one
question per answer, from easy-VQA's training images (the imagefolder needs a training split).
An imagefolder's answer classes are its training answers, most frequent first, ties in
alphabetical order: here the 13 answers alphabetically, another order than easy-VQA's.

    .venv/bin/python scripts/easy_vqa_as_imagefolder.py --out /tmp/ans/easy_vqa_imagefolder
    .venv/bin/vlfuse test --config configs/imagefolder_vqa.yaml \\
        --data.init_args.data_dir /tmp/ans/easy_vqa_imagefolder --model.pretrained runs/easy_vqa/latest/model
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from vlfuse.data import ImageQuestions
from vlfuse.data.easy_vqa import easy_vqa_answers, load_easy_vqa
from vlfuse.data.imagefolder import METADATA_FILE
from vlfuse.datamodules import ImageFolderDataModule


def write_split(folder: Path, rows: list[tuple[ImageQuestions, str, str]]) -> None:
    """Copy each row's image into ``folder`` and write ``metadata.jsonl``: one line per (image, question, answer)."""
    folder.mkdir(parents=True, exist_ok=False)
    with open(folder / METADATA_FILE, "w") as metadata:
        for record, question, answer in rows:
            name = f"{record.image_id.replace('/', '_')}.png"
            if not (folder / name).exists():
                shutil.copyfile(record.image, folder / name)
            metadata.write(json.dumps({"file_name": name, "question": question, "answer": answer}) + "\n")


def every_question(records: list[ImageQuestions]) -> list[tuple[ImageQuestions, str, str]]:
    """Every (image, question, answer) of ``records``, in order."""
    return [(r, q, a) for r in records for q, a in zip(r.questions, r.answers)]


def one_per_answer(records: list[ImageQuestions], occurrence: int) -> list[tuple[ImageQuestions, str, str]]:
    """For each answer, its ``occurrence``-th question (0 the first) in ``records``."""
    seen: dict[str, int] = {}
    rows = []
    for row in every_question(records):
        answer = row[2]
        if seen.get(answer, 0) == occurrence:
            rows.append(row)
        seen[answer] = seen.get(answer, 0) + 1
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path, help="the imagefolder to write (must not exist)")
    args = parser.parse_args()
    if args.out.exists():
        raise SystemExit(f"error: --out {args.out} exists; give a new folder")

    train = load_easy_vqa("train")
    write_split(args.out / "train", one_per_answer(train, 0))
    write_split(args.out / "validation", one_per_answer(train, 1))
    write_split(args.out / "test", every_question(load_easy_vqa("test")))
    written = ImageFolderDataModule(data_dir=str(args.out))
    questions = sum(len(r.questions) for r in written.records("test"))
    print(f"wrote {args.out}: {questions} test questions on {len(written.records('test'))} images")
    print(f"easy-VQA's answers:        {' '.join(easy_vqa_answers())}")
    print(f"the imagefolder's answers: {' '.join(written.answers)}")


if __name__ == "__main__":
    main()
