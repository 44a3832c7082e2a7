"""What each word of a map-program model does, and the program it runs on SHAPES val questions.

For every word of the val questions: its keep / intersect / move weights and, for a word that
moves, the step its set moves by (rows, columns; (0, 1) is one cell right). Then, for a few val
questions, the set of cells after each word (right to left), as the model reads it.

    .venv/bin/python scripts/shapes_program_trace.py --model runs/shapes/latest/model --examples 2
"""

from __future__ import annotations

import argparse

import torch
from _common import add_model_argument, load_model

from vlfuse.analysis.tables import markdown_table
from vlfuse.data.shapes import distinct_queries
from vlfuse.datamodules import ShapesDataModule
from vlfuse.model import VLFuseModel
from vlfuse.fusers import OPERATIONS, MapProgramFuser


def word_table(model: VLFuseModel, words: list[str]) -> str:
    """A markdown table of what each word does."""
    ids = torch.tensor([model.tokenizer.convert_tokens_to_ids(words)])  # (1, W)
    reader = model.fuser.reader
    weights, offsets = reader.operations(model.encode_questions(ids, torch.ones_like(ids)))
    steps = reader.offset_steps()
    rows = []
    for word, mix, offset in zip(words, weights[0].tolist(), offsets[0]):
        best = int(offset.argmax())
        move = f"{steps[best]} ({offset[best]:.2f})" if mix[2] > 0.5 else ""
        rows.append([word, *mix, move])
    header = ["word", *OPERATIONS, "moves the set by (weight)"]
    formats = [None, *["{:.2f}"] * len(OPERATIONS), None]
    return markdown_table(header, rows, formats=formats, align="l" + "r" * len(OPERATIONS) + "l")


def grid(cells: torch.Tensor, rows: int, cols: int) -> list[str]:
    """A map ``(N,)`` as text rows: ``#`` at least 0.5, ``+`` at least 0.1, ``.`` below."""
    marks = ["#" if v >= 0.5 else "+" if v >= 0.1 else "." for v in cells.tolist()]
    return ["".join(marks[r * cols : (r + 1) * cols]) for r in range(rows)]


def trace(model: VLFuseModel, image: torch.Tensor, question: str) -> str:
    """The set after each word of ``question`` about ``image`` (1, 3, S, S), right to left."""
    tokens = model.processor.tokenize([question])
    ids, mask = tokens["input_ids"], tokens["attention_mask"].bool()
    words, patches = model.encode_questions(ids, tokens["attention_mask"]), model.encode_images(image).features
    evidence, maps = model.fuser.reader(words, mask, patches, return_maps=True)
    names = model.tokenizer.convert_ids_to_tokens(ids[0].tolist())
    rows, cols = model.fuser.reader.grid_size
    columns = [(name, grid(maps[0, t], rows, cols)) for t, name in reversed(list(enumerate(names))) if mask[0, t]]
    width = max(len(name) for name, _ in columns)
    lines = ["  ".join(name.ljust(width) for name, _ in columns)]
    lines += ["  ".join(cells[r].ljust(width) for _, cells in columns) for r in range(rows)]
    answer = model.answers[int(model.read_out(evidence, mask).argmax())]
    return "\n".join(lines) + f"\nevidence {evidence.item():.2f} -> {answer}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser, help="a directory written by save_pretrained (fuser map_program)")
    parser.add_argument("--data-dir", default=None, help="the released SHAPES files (default: see ShapesDataModule)")
    parser.add_argument("--examples", type=int, default=2, help="val questions to trace (one image each)")
    args = parser.parse_args()

    model = load_model(args.model)
    if not isinstance(model.fuser, MapProgramFuser):
        parser.error(f"{args.model} has no map-program reader (fuser {model.config.fuser.type!r})")
    data = ShapesDataModule(data_dir=args.data_dir, image_size=model.config.image.image_size)
    records = data.records("val")
    queries = data.queries("val")
    words = sorted({w for record in records for q in record.questions for w in model.tokenizer.tokenize(q)})
    with torch.no_grad():
        print(word_table(model, [model.tokenizer.cls_token, *words, model.tokenizer.sep_token]))
        first_rows = [queries.index(q) for q in distinct_queries(queries)][: args.examples]
        for row in first_rows:
            record = records[row]
            image = data.dataset("val")[row]["pixel_values"].unsqueeze(0)
            print(f"\n{queries[row]}  ({record.questions[0]}; answer {record.answers[0]}), right to left:")
            print(trace(model, image, record.questions[0]))


if __name__ == "__main__":
    main()
