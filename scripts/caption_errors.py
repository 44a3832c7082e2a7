"""What a SHAPES caption model gets wrong: its greedy captions of the held-apart test scenes, or of
the released SHAPES images, each false sentence sorted by kind, the confusion of shapes and
colours, and examples.

A sentence of the grammar (docs/captioning-data.md) has a subject (``a COLOUR SHAPE``), and a
relation sentence an object too (``is left of`` / ``is above`` ``a COLOUR SHAPE``). A false sentence is

- ``unparsed``: not a sentence of the grammar;
- ``no such subject``: no object of the scene is its subject;
- ``wrong neighbour``: its subject is in the scene, but no such subject has that object directly
  to its right (``left of``) or below it (``above``).

The confusion tables set what the caption said about each object against the scene: the caption's
subjects are aligned with the scene's objects in reading order (one sentence per object, as the
grammar writes them; an edit-distance alignment, so that a left-out or added sentence shifts
nothing), and each object's shape and colour are counted against the subject aligned with it
(``missed``: no sentence is about it).

With ``--released val``, the images are the released SHAPES val images (the original renderer's,
each distinct image once) and each caption is checked against the scene read from the image's
pixels (:func:`vlfuse.data.shapes.read_scenes`; only unambiguous readings).

Prints the fact precision and object recall (as validation and test log them), the count of each
kind, the confusion tables and the first ``--examples`` captions with a false sentence next to
their reference.

    .venv/bin/python scripts/caption_errors.py --model runs/shapes_captions/latest/model
    .venv/bin/python scripts/caption_errors.py --model runs/shapes_captions/latest/model --released val
"""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path
from typing import Optional, Sequence

import torch
from _common import add_threads_argument, set_threads
from torch.utils.data import DataLoader

from vlfuse.analysis.tables import markdown_table
from vlfuse.captioning.generate import greedy
from vlfuse.captioning.grammar import Sentence, Thing, describe_sentences, parse_leniently, witnesses
from vlfuse.captioning.metrics import SceneCaptionScores
from vlfuse.captioning.model import CaptionModel
from vlfuse.data.captions import CaptionDataset, collate_captions
from vlfuse.data.shapes import COLOURS, SHAPES, Scene
from vlfuse.datamodules.captions import ShapesCaptionsDataModule, released_captions

MISSED = "missed"
"""Column of an object that no sentence of the caption is about."""
GAP_COST = 1.5
"""Alignment cost of an object without a sentence, or a sentence without an object (a wrong colour
and a wrong shape cost 1 each, so two wrong attributes are still a substitution, not two gaps)."""


def sentence_error(sentence, scene) -> str | None:
    """The kind of error of one parsed sentence (``None``: unparsed) about ``scene``; ``None`` if it is true."""
    if sentence is None:
        return "unparsed"
    if witnesses(sentence, scene):
        return None
    subjects = {s.subject for s in describe_sentences(scene)}
    return "wrong neighbour" if sentence.subject in subjects and sentence.relation else "no such subject"


def align_subjects(sentences: Sequence[Optional[Sentence]], scene: Scene) -> list[tuple[Thing, Optional[Thing]]]:
    """Each object of ``scene`` (reading order) with the subject of the sentence aligned with it, or ``None``.

    The alignment is the cheapest edit of the caption's subjects into the scene's objects: a
    substitution costs the number of differing attributes (colour, shape), a left-out or extra
    sentence :data:`GAP_COST`; an unparsed sentence (``None``) may stand in an object's place, which
    then counts as missed (``None``), for :data:`GAP_COST` too.
    """
    said = [s.subject if s is not None else None for s in sentences]
    truth = [s.subject for s in describe_sentences(scene)]

    def substitution(a: Optional[Thing], b: Thing) -> float:
        return GAP_COST if a is None else float(a[0] != b[0]) + float(a[1] != b[1])

    # cost[i][j]: the cheapest alignment of said[:i] with truth[:j]
    cost = [[GAP_COST * (i + j) if i == 0 or j == 0 else 0.0 for j in range(len(truth) + 1)] for i in range(len(said) + 1)]
    for i in range(1, len(said) + 1):
        for j in range(1, len(truth) + 1):
            cost[i][j] = min(
                cost[i - 1][j - 1] + substitution(said[i - 1], truth[j - 1]),
                cost[i - 1][j] + GAP_COST,
                cost[i][j - 1] + GAP_COST,
            )
    pairs: list[tuple[Thing, Optional[Thing]]] = []
    i, j = len(said), len(truth)
    while j > 0:
        if i > 0 and cost[i][j] == cost[i - 1][j - 1] + substitution(said[i - 1], truth[j - 1]):
            pairs.append((truth[j - 1], said[i - 1]))
            i, j = i - 1, j - 1
        elif i > 0 and cost[i][j] == cost[i - 1][j] + GAP_COST:
            i -= 1
        else:
            pairs.append((truth[j - 1], None))
            j -= 1
    return pairs[::-1]


def confusion_tables(confusion: Counter) -> str:
    """Markdown tables of shapes and of colours: one row per attribute of the scene's objects, one
    column per attribute the caption said (and ``missed``); ``confusion`` counts ``(true, said)`` pairs."""
    tables = []
    for name, index, values in (("shape", 1, SHAPES), ("colour", 0, COLOURS)):  # a Thing is (colour, shape)
        counts: Counter = Counter()
        for (truth, said), n in confusion.items():
            counts[truth[index], MISSED if said is None else said[index]] += n
        rows = []
        for value in values:
            total = sum(counts[value, column] for column in (*values, MISSED))
            right = counts[value, value]
            rows.append([value, *(counts[value, column] for column in (*values, MISSED)), right / total if total else None])
        header = [f"{name} (scene) \\ said", *values, MISSED, "right"]
        tables.append(markdown_table(header, rows, formats=[None] * (len(values) + 2) + ["{:.2%}"]))
    return "\n\n".join(tables)


def load_images(args, image_size: int) -> tuple[CaptionDataset, str]:
    """The images to caption and a phrase naming them: the held-apart test scenes, or a released split."""
    if args.released is None:
        data = ShapesCaptionsDataModule(num_test_scenes=args.scenes or 1000, image_size=image_size)
        return data.dataset("test"), "test scenes"
    try:
        released = released_captions(args.shapes_dir, args.released)
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: --released {args.released}: {err}") from None
    records = released.records[: args.scenes]
    print(f"released {args.released}: {released.rows} rows, {released.distinct} distinct images, "
          f"{released.ambiguous} left out as ambiguous readings; captioning {len(records)}")
    return CaptionDataset(records, image_size), f"released {args.released} images"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR", help="a caption model written by vlfuse fit")
    parser.add_argument("--scenes", type=int, default=None,
                        help="images: the first N of the held-apart test split (default 1000), or of the released "
                             "split's distinct images (default all)")
    parser.add_argument("--released", metavar="SPLIT", choices=("val", "train.small", "train.tiny"),
                        help="caption the images of this released SHAPES split instead, checked against their read scenes")
    parser.add_argument("--shapes-dir", type=Path, metavar="DIR",
                        help="the released SHAPES files (default $VLFUSE_SHAPES_DIR, then ../shared/data/shapes)")
    parser.add_argument("--examples", type=int, default=5, help="captions with a false sentence to print")
    parser.add_argument("--batch-size", type=int, default=100)
    add_threads_argument(parser, default=1)
    args = parser.parse_args()
    set_threads(args.threads)
    try:
        model = CaptionModel.from_pretrained(args.model).eval()
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: --model {args.model}: {err}") from None
    dataset, what = load_images(args, model.config.image.image_size)
    loader = DataLoader(dataset, batch_size=args.batch_size, collate_fn=collate_captions)
    scores = SceneCaptionScores()
    kinds: Counter = Counter()
    confusion: Counter = Counter()
    examples = []
    with torch.no_grad():
        for batch in loader:
            captions = [c.text for c in greedy(model, model.encode_images(batch["pixel_values"]))]
            scores.update(captions, batch["scenes"])
            for caption, scene, references in zip(captions, batch["scenes"], batch["references"]):
                sentences = parse_leniently(caption)
                confusion.update(align_subjects(sentences, scene))
                errors = [e for e in (sentence_error(s, scene) for s in sentences) if e is not None]
                kinds.update(errors)
                if errors and len(examples) < args.examples:
                    examples.append((references[0], caption, errors))
    result = scores.compute()
    sentences, objects = int(scores.sentences), int(scores.objects)
    print(f"{len(loader.dataset)} {what}: fact precision {result['fact_precision']:.4f} "
          f"({sentences - int(scores.true_sentences)} false of {sentences} sentences), object recall "
          f"{result['object_recall']:.4f} ({objects - int(scores.described_objects)} of {objects} objects missed)")
    for kind, count in kinds.most_common():
        print(f"  {kind}: {count}")
    print("\nWhat the caption said about each object of the scene (its sentence's subject):\n")
    print(confusion_tables(confusion))
    for reference, caption, errors in examples:
        print(f"\nreference: {reference}\ngenerated: {caption}\nfalse:     {', '.join(errors)}")


if __name__ == "__main__":
    main()
