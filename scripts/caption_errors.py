"""What a SHAPES caption model gets wrong: its greedy captions of the held-apart test scenes, each
false sentence sorted by kind, with examples.

A sentence of the grammar (docs/captioning-data.md) has a subject (``a COLOUR SHAPE``), and a
relation sentence an object too (``is left of`` / ``is above`` ``a COLOUR SHAPE``). A false sentence is

- ``unparsed``: not a sentence of the grammar;
- ``no such subject``: no object of the scene is its subject;
- ``wrong neighbour``: its subject is in the scene, but no such subject has that object directly
  to its right (``left of``) or below it (``above``).

Prints the fact precision and object recall (as validation and test log them), the count of each
kind, and the first ``--examples`` captions with a false sentence next to their reference.

    .venv/bin/python scripts/caption_errors.py --model runs/shapes_captions/latest/model
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from _common import add_threads_argument, set_threads
from torch.utils.data import DataLoader

from vlfuse.captioning.generate import greedy
from vlfuse.captioning.grammar import describe_sentences, parse_leniently, witnesses
from vlfuse.captioning.metrics import SceneCaptionScores
from vlfuse.captioning.model import CaptionModel
from vlfuse.data.captions import collate_captions
from vlfuse.datamodules.captions import ShapesCaptionsDataModule


def sentence_error(sentence, scene) -> str | None:
    """The kind of error of one parsed sentence (``None``: unparsed) about ``scene``; ``None`` if it is true."""
    if sentence is None:
        return "unparsed"
    if witnesses(sentence, scene):
        return None
    subjects = {s.subject for s in describe_sentences(scene)}
    return "wrong neighbour" if sentence.subject in subjects and sentence.relation else "no such subject"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, metavar="DIR", help="a caption model written by vlfuse fit")
    parser.add_argument("--scenes", type=int, default=1000, help="test scenes (the first N of the held-apart test split)")
    parser.add_argument("--examples", type=int, default=5, help="captions with a false sentence to print")
    parser.add_argument("--batch-size", type=int, default=100)
    add_threads_argument(parser, default=1)
    args = parser.parse_args()
    set_threads(args.threads)
    try:
        model = CaptionModel.from_pretrained(args.model).eval()
    except (FileNotFoundError, ValueError) as err:
        raise SystemExit(f"error: --model {args.model}: {err}") from None
    data = ShapesCaptionsDataModule(num_test_scenes=args.scenes, image_size=model.config.image.image_size)
    loader = DataLoader(data.dataset("test"), batch_size=args.batch_size, collate_fn=collate_captions)
    scores = SceneCaptionScores()
    kinds: Counter = Counter()
    examples = []
    with torch.no_grad():
        for batch in loader:
            captions = [c.text for c in greedy(model, model.encode_images(batch["pixel_values"]))]
            scores.update(captions, batch["scenes"])
            for caption, scene, references in zip(captions, batch["scenes"], batch["references"]):
                errors = [e for e in (sentence_error(s, scene) for s in parse_leniently(caption)) if e is not None]
                kinds.update(errors)
                if errors and len(examples) < args.examples:
                    examples.append((references[0], caption, errors))
    result = scores.compute()
    sentences, objects = int(scores.sentences), int(scores.objects)
    print(f"{len(loader.dataset)} test scenes: fact precision {result['fact_precision']:.4f} "
          f"({sentences - int(scores.true_sentences)} false of {sentences} sentences), object recall "
          f"{result['object_recall']:.4f} ({objects - int(scores.described_objects)} of {objects} objects missed)")
    for kind, count in kinds.most_common():
        print(f"  {kind}: {count}")
    for reference, caption, errors in examples:
        print(f"\nreference: {reference}\ngenerated: {caption}\nfalse:     {', '.join(errors)}")


if __name__ == "__main__":
    main()
