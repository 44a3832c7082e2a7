"""The pointing game: how often an explanation's maximum falls on the object the question is about.

For each question whose answer depends on one object, each method of :mod:`vlfuse.analysis.explain`
draws its map of the whole question; a hit is a maximum in a patch of the object, by two rules
(:data:`SHARES`): the patch touches the object, or at least 25% of it is the object.
Reported per method and layer, per head (attention, gradcam), against three baselines: a random
map (the patch of its maximum drawn at random, seeded), the uniform map (its ties broken at
random: the expected hit rate is the share of the patches that are the object's) and the centre patch;
with ``--untrained-baseline``, also every method on an untrained model of the same architecture
(Adebayo et al. 2018's sanity check: a method that points as well there reads the image, not the model).

- ``--data easy_vqa``: the easy-VQA **test** split (``--split val``: the validation images that
  ``vlfuse fit`` holds out of train by default), "what shape / what color" questions; the image
  holds one shape, whose pixels are those off the background (in the image as the model sees it),
  as ``vlfuse analyze`` counts them (:func:`vlfuse.analysis.head_stats.object_cells`).
- ``--data shapes``: SHAPES **val** (never test), questions ``(is A B)`` whose first argument ``A``
  names exactly one cell of the scene (read from the image, :func:`vlfuse.data.shapes.read_scene`);
  the object's patches are those over that cell. Each method with a map per word is also scored on
  the map of ``A``'s word alone (``METHOD, the named word's map``): does the word that names the
  object look at it?

    .venv/bin/python scripts/pointing_game.py --model runs/easy_vqa/latest/model --limit-images 300
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from _common import add_model_argument, load_model
from PIL import Image
from tqdm import tqdm

from vlfuse import runtime
from vlfuse.analysis.explain import METHODS, MethodRefused, explain_pixels, untrained_copy
from vlfuse.analysis.head_roles import HeadRules
from vlfuse.analysis.head_stats import object_cells
from vlfuse.analysis.tables import markdown_table
from vlfuse.data.easy_vqa import load_easy_vqa, question_kind
from vlfuse.data.shapes import CELL, denotation, load_released_split, parse_query, read_scene, to_english
from vlfuse.datamodules import EasyVQADataModule
from vlfuse.datamodules.shapes import find_shapes_dir

RULES = HeadRules()
"""Which pixels are foreground: ``pixel_tolerance``, as ``vlfuse analyze`` counts them."""
SHARES = {"patch touches the object": 1e-6, "patch >= 25% object": RULES.cell_share}
"""The two rules for a patch of the object: the share of its pixels (in the image as the model sees
it) that are foreground; the second is ``vlfuse analyze``'s object patch."""


@dataclass
class Item:
    """One question about an image that holds one object: its patches are those with foreground
    pixels (:func:`object_cells`).

    Attributes:
        image: ``(H, W, 3)`` uint8.
        question: the question, as the model is asked it.
    """

    image: np.ndarray
    question: str

    @property
    def named_word(self) -> str | None:
        """The question's word that names the object, when one does (SHAPES); ``None`` otherwise."""
        return None

    def region(self, pixels: torch.Tensor, grid: tuple[int, int], share: float) -> np.ndarray:
        """``(rows, cols)`` bool: the patches at least ``share`` of whose pixels are foreground, in
        ``pixels`` ``(1, 3, S, S)`` as the model sees the image."""
        objects = object_cells(pixels, grid, tolerance=RULES.pixel_tolerance, min_share=share)
        return objects[0].reshape(grid).numpy()


@dataclass
class CellItem(Item):
    """A question about the object of one scene cell (SHAPES): its patches are those over the cell.

    Attributes:
        cell: ``(H, W)`` bool, the cell's pixels.
        word: the word of ``A`` (a colour or a shape), which names the object.
    """

    cell: np.ndarray
    word: str

    @property
    def named_word(self) -> str:
        return self.word

    def region(self, pixels: torch.Tensor, grid: tuple[int, int], share: float) -> np.ndarray:
        """The patches over the cell (it holds an object, by the scene): ``share`` has no part."""
        return patch_region(self.cell, grid)


def patch_region(where: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """``(rows, cols)`` bool: the patches (the grid laid over the whole image) that overlap ``where`` ``(H, W)``."""
    height, width = where.shape
    rows = np.linspace(0, height, grid[0] + 1).round().astype(int)
    cols = np.linspace(0, width, grid[1] + 1).round().astype(int)
    return np.array([[where[rows[r]:rows[r + 1], cols[c]:cols[c + 1]].any() for c in range(grid[1])]
                     for r in range(grid[0])])


def hit(patch_map: np.ndarray, region: np.ndarray) -> bool:
    """Whether the maximum of ``patch_map`` ``(rows, cols)`` falls in ``region`` (the first maximum, row-major)."""
    return bool(region.flat[int(np.argmax(patch_map))])


def easy_vqa_items(limit_images: int | None, split: str = "test") -> Iterator[Item]:
    """The "what" questions of ``split``: ``test``, or ``val`` (the images :class:`EasyVQADataModule`
    holds out of train by default); the image holds one object."""
    records = load_easy_vqa("test") if split == "test" else EasyVQADataModule().load_records("val")
    for record in records[:limit_images]:
        image = np.asarray(Image.open(record.image).convert("RGB"))
        for question in record.questions:
            if question_kind(question) in ("what colour", "what shape"):
                yield Item(image, question)


def shapes_items(data_dir: Path, limit_images: int | None) -> Iterator[Item]:
    """SHAPES val questions whose first argument names one cell (206 of the 1,024), in English as the
    datamodule asks them."""
    split = load_released_split(data_dir, "val")
    for image, query in list(zip(split.images, split.queries))[:limit_images]:
        _, first, _ = parse_query(query)
        cells = denotation(first, read_scene(image))
        if cells.sum() != 1:
            continue
        block = np.kron(cells, np.ones((CELL, CELL), dtype=bool))  # (30, 30): the cell's pixels
        yield CellItem(np.ascontiguousarray(image), to_english(query), block, first)


def usable_runs(model, item: Item) -> tuple[list[tuple[str, int | None]], dict[str, str]]:
    """``(method, layer)`` pairs the model can be explained by, tried on ``item``, and
    ``{method: why not}`` for those it refuses (the SHAPES cell readers keep no values for gradcam)."""
    pixels = model.processor.image(item.image)[None]
    layers = range(model.num_fusion_layers)
    runs, refused = [], {}
    for name in METHODS:
        chosen = list(layers) if METHODS[name].per_layer else [None]
        try:
            explain_pixels(model, pixels, item.question, name, layer=chosen[0])
        except MethodRefused as err:
            refused[name] = str(err)
            continue
        runs += [(name, layer) for layer in chosen]
    return runs, refused


@dataclass
class Scores:
    """What :func:`score` counts; each count is ``[hits by each of SHARES, questions]``.

    Attributes:
        methods: ``{method (and layer): counts}``.
        heads: ``{method (and layer) and head: counts}`` of each head's map.
        baselines: ``{baseline: counts}``.
        by_answer: ``{method (and layer) -> the model's answer: counts}``.
        by_word: ``{method (and layer), the named word's map: the word: counts}`` (SHAPES).
        left_out: questions left out because their object has no patch.
        refused: ``{method: why}`` for the methods the model refuses.
    """

    methods: dict[str, list]
    heads: dict[str, list]
    baselines: dict[str, list]
    by_answer: dict[str, list]
    by_word: dict[str, list]
    left_out: int
    refused: dict[str, str]


def score(model, items: list[Item], seed: int, progress: str | None = None) -> Scores:
    """The hit counts of every method the model takes, of each head and of the baselines; with
    ``progress``, a bar of the questions so named on standard error."""
    grid = tuple(model.image_encoder.grid_size)
    rng = np.random.default_rng(seed)
    runs, refused = usable_runs(model, items[0])
    keys = [f"{name}" + ("" if layer is None else f" layer {layer}") for name, layer in runs]
    methods = {key: [0] * (len(SHARES) + 1) for key in keys}  # the whole question's maps first, as run
    heads: dict[str, list] = {}
    by_answer: dict[str, list] = {}
    by_word: dict[str, list] = {}
    baselines = {name: [0] * (len(SHARES) + 1) for name in ("random map", "uniform map (expected)", "centre patch")}
    left_out = 0

    def count(counts: list, value) -> None:
        for i, region in enumerate(regions):
            counts[i] += value(region)
        counts[-1] += 1

    def point(table: dict[str, list], key: str, patch_map: np.ndarray) -> None:
        """Count whether ``patch_map``'s maximum hits the object, under ``key`` of ``table``."""
        count(table.setdefault(key, [0] * (len(SHARES) + 1)), lambda region: hit(patch_map, region))

    in_a_log = not sys.stderr.isatty()  # a frame each 30 s there, not each 0.1 s
    for item in tqdm(items, desc=progress, unit="question", file=sys.stderr, disable=progress is None, mininterval=30 if in_a_log else 0.1):
        pixels = model.processor.image(item.image)[None]
        regions = [item.region(pixels, grid, share) for share in SHARES.values()]
        if not all(region.any() for region in regions):
            left_out += 1
            continue
        for (name, layer), key in zip(runs, keys):
            explanation = explain_pixels(model, pixels, item.question, name, layer=layer)
            patch_map = explanation.patch_map()
            point(methods, key, patch_map)
            point(by_answer, f"{key} -> {explanation.answer}", patch_map)
            if item.named_word is not None and explanation.token_maps is not None:
                word_map = explanation.token_patch_maps()[:, named_token(explanation, item)].mean(0)  # (rows, cols)
                word_key = f"{key}, the named word's map"
                point(methods, word_key, word_map)
                point(by_answer, f"{word_key} -> {explanation.answer}", word_map)
                point(by_word, f"{word_key}: {item.named_word}", word_map)
            if len(explanation.heads) > 1:
                per_head = explanation.token_patch_maps().mean(1)  # (H, rows, cols): each head's question map
                for label, head_map in zip(explanation.heads, per_head):
                    point(heads, f"{key} {label}", head_map)
        random_map = rng.random(grid)
        count(baselines["random map"], lambda region: hit(random_map, region))
        count(baselines["uniform map (expected)"], lambda region: float(region.mean()))
        count(baselines["centre patch"], lambda region: bool(region[grid[0] // 2, grid[1] // 2]))
    return Scores(methods, heads, baselines, dict(sorted(by_answer.items())), dict(sorted(by_word.items())), left_out, refused)


def named_token(explanation, item: Item) -> int:
    """The index in ``explanation.tokens`` of the first token that is ``item``'s named word (in SHAPES'
    English ``A`` is the first word after "is": "is a green shape right of a blue shape")."""
    if item.named_word not in explanation.tokens:
        raise ValueError(f"{item.question!r}: the tokenizer wrote {explanation.tokens}, without {item.named_word!r}")
    return explanation.tokens.index(item.named_word)


def add_untrained_baseline(scores: Scores, model, items: list[Item], seed: int, progress: str | None = None) -> None:
    """Score every method on an untrained model of ``model``'s architecture (:func:`untrained_copy`,
    drawn with ``seed``) and add each as a baseline, ``untrained model: METHOD``: what a method
    scores without anything learnt, from the image alone (``progress``: see :func:`score`)."""
    untrained = score(untrained_copy(model, seed), items, seed, progress)
    scores.baselines.update({f"untrained model: {name}": counts for name, counts in untrained.methods.items()})


def rates(counts: list) -> list[str]:
    """The hit rate by each of SHARES, formatted."""
    return [f"{hits / counts[-1]:.4f}" if counts[-1] else "nan" for hits in counts[:-1]]


def report(scores: Scores, by_answer: bool = False) -> str:
    """The markdown tables: methods and baselines, then (``by_answer``) each method's hits by the
    model's answer and the named word's maps' hits by the word, then the best, worst and median head
    of each layer (by the first of SHARES)."""
    columns = [f"hit rate: {name}" for name in SHARES]
    rows = [[name, *rates(c), str(c[-1])] for name, c in scores.methods.items()]
    rows += [[f"baseline: {name}", *rates(c), str(c[-1])] for name, c in scores.baselines.items()]
    lines = [markdown_table(["method", *columns, "questions"], rows), ""]
    if by_answer:
        rows = [[name, *rates(c), str(c[-1])] for name, c in scores.by_answer.items()]
        lines += [markdown_table(["method -> the model's answer", *columns, "questions"], rows), ""]
        if scores.by_word:
            rows = [[name, *rates(c), str(c[-1])] for name, c in scores.by_word.items()]
            lines += [markdown_table(["method, the named word's map: the word", *columns, "questions"], rows), ""]
    by_layer: dict[str, list[tuple[float, str]]] = {}
    for key, counts in scores.heads.items():
        layer_key, head = key.rsplit(" head ", 1)
        by_layer.setdefault(layer_key, []).append((counts[0] / counts[-1], head))
    head_rows = [[layer_key, f"head {max(v)[1]}: {max(v)[0]:.4f}", f"head {min(v)[1]}: {min(v)[0]:.4f}",
                  f"{np.median([r for r, _ in v]):.4f}"] for layer_key, v in by_layer.items()]
    lines.append(markdown_table([f"heads of ({next(iter(SHARES))})", "best head", "worst head", "median head"], head_rows))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser)
    parser.add_argument("--data", choices=("easy_vqa", "shapes"), default="easy_vqa",
                        help="easy_vqa (test split, 'what' questions) or shapes (val split, one-object questions)")
    parser.add_argument("--split", choices=("test", "val"), default="test",
                        help="easy_vqa's split: test, or val (the images fit holds out of train by default)")
    parser.add_argument("--shapes-dir", type=Path, metavar="DIR",
                        help="the SHAPES files (default $VLFUSE_SHAPES_DIR, then ../shared/data/shapes)")
    parser.add_argument("--limit-images", type=int, default=None, metavar="N", help="only the first N images (easy-VQA) or rows (SHAPES)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random-map baseline (default 0)")
    parser.add_argument("--untrained-baseline", action="store_true",
                        help="also score every method on an untrained model of the same architecture (seeded by "
                             "--seed): a method that points as well there reads the image, not the model")
    parser.add_argument("--by-answer", action="store_true", help="also each method's hit rate by the model's answer (SHAPES: and by the named word)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the counts as JSON here")
    args = parser.parse_args()

    torch.set_num_threads(runtime.DEFAULT_THREADS)
    model = load_model(args.model)
    if args.data == "easy_vqa":
        items = list(easy_vqa_items(args.limit_images, args.split))
    else:
        if args.split != "test":
            raise SystemExit("error: --split: SHAPES is always scored on its val split")
        try:
            items = list(shapes_items(find_shapes_dir(args.shapes_dir), args.limit_images))
        except (FileNotFoundError, ValueError) as err:
            raise SystemExit(f"error: --shapes-dir: {err}") from None
    if not items:
        raise SystemExit(f"error: --data {args.data}: no question about one object")
    scores = score(model, items, args.seed, progress="the model")  # minutes: every method explains every question
    if args.untrained_baseline:
        add_untrained_baseline(scores, model, items, args.seed, progress="an untrained model")
    print(report(scores, args.by_answer))
    for name, why in scores.refused.items():
        print(f"\n{name}: not scored, this model refuses it: {why}")
    print(f"\n{len(items)} questions; {scores.left_out} left out: their object has no patch")
    if args.json is not None:
        args.json.write_text(json.dumps({"model": str(args.model), "data": args.data, **dataclasses.asdict(scores),
                                         "questions": len(items)}, indent=1))


if __name__ == "__main__":
    main()
