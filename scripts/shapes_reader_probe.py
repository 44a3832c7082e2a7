"""What a SHAPES cell reader (``fuser: cell_steps`` or ``cell_moves``) has learnt, word by word:
the probes that explained why runs stalled or did not compose (docs/results.md, issue 38).

- ``finds``: for each colour and shape word, how well the word's find picks the cells that hold
  it: the area under the ROC curve of its best head's scores (and of the mean head's);
- ``keys``: for each head, a linear probe of its find key (after the QK-norm): does it still tell
  each cell's shape and colour? A stalled run's heads had all turned to colour; the same probe of
  the patch tokens the keys are projected from says whether the image encoder or the projection lost it.
  And how far each head's keys put a circle from a square of the same colour (squared Mahalanobis
  distance): about 7 at the start, 30-50 once a run has learnt the shapes, 3-4 on a stalled one;
- ``shifts`` (``cell_moves`` only): where each relation word moves the kept set;
- ``states``: for each question pattern, the soft set once each part of the question is read
  (``R1 C1``: "right of a green shape"), against the cells that part denotes: the mean of ``m``
  on them and on every other cell. A move that keeps some of where it started shows up here.

The finds and keys read generated scenes (every cell known); the states read ``--split``:
``val``, the released val images with the scenes read back from their pixels (the unambiguous
ones), or ``train``, new images of the training questions.

    .venv/bin/python scripts/shapes_reader_probe.py --model runs/shapes_fusion/latest/model
    .venv/bin/python scripts/shapes_reader_probe.py --model runs/shapes_fusion/latest/model --parts states --split train
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Iterator

import numpy as np
import torch
import torch.nn.functional as F
from torchmetrics.functional.classification import binary_auroc

from _common import add_model_argument, load_model
from shapes_probe import cell_features, cell_labels, probe_accuracy

from vlfuse.data.shapes import (
    COLOURS,
    RELATIONS,
    SHAPES,
    ShapesSplit,
    denotation,
    distinct_queries,
    english_phrases,
    generate_training_set,
    load_released_split,
    parse_query,
    question_pattern,
    read_questions,
    read_scenes,
    to_english,
)
from vlfuse.data.transforms import preprocess_image
from vlfuse.datamodules.shapes import TRAINING_QUESTIONS_SPLIT, find_shapes_dir
from vlfuse.fusers import CellMovesFuser, CellStepsFuser
from vlfuse.model import VLFuseModel

PARTS = ("finds", "keys", "shifts", "states")


def reader_of(model: VLFuseModel) -> CellStepsFuser:
    """The model's cell reader, or a clear error naming the fuser it has instead."""
    if not isinstance(model.fuser, CellStepsFuser):
        raise SystemExit(f"--model: the probes read a cell_steps or cell_moves fuser; this model's is {model.config.fuser.type!r}")
    return model.fuser


def patches_of(model: VLFuseModel, images: np.ndarray, batch: int = 250) -> torch.Tensor:
    """The reader's patch tokens of uint8 images ``(N, 30, 30, 3)``: ``(N, cells, d)``."""
    size, out = model.config.image.image_size, []
    with torch.no_grad():
        for start in range(0, len(images), batch):
            pixels = torch.stack([preprocess_image(image, size) for image in images[start : start + batch]])
            out.append(model.fuser.image_context(model.embed_images(pixels), model.image_encoder.num_prefix_tokens))
    return torch.cat(out)


def generated_scenes(count: int) -> tuple[list, np.ndarray]:
    """``count`` scenes (every cell known) and their images, generated from the training questions
    (``seed=1``): what the finds and keys probes read."""
    queries = distinct_queries(read_questions(find_shapes_dir(), TRAINING_QUESTIONS_SPLIT).queries)
    data = generate_training_set(queries, seed=1, images_per_question=-(-count // len(queries)))
    return data.scenes[:count], data.images[:count]


def word_features(model: VLFuseModel, words: list[str]) -> torch.Tensor:
    """What the reader reads of each single word ``(len(words), fusion width)``: the model's own
    reading of the word as a question (word embedding, norm and the model's ``text_proj``)."""
    tokens = model.processor.tokenize(words)
    mask = tokens["attention_mask"].bool()
    with torch.no_grad():
        features = model.encode_questions(tokens["input_ids"], mask.long())  # (B, Lt, fusion width)
    return features[torch.arange(len(words)), mask.sum(1) - 2]  # the word before [SEP]


def find_aucs(model: VLFuseModel, patches: torch.Tensor, scenes) -> dict[str, tuple[float, int]]:
    """Per colour and shape word: (the AUC of its best head, that head) of its find scores against
    the cells holding it (cells of finer patch grids: the mean of their patches' scores)."""
    colours, shapes = cell_labels(scenes)
    words = list(COLOURS) + list(SHAPES)
    features = word_features(model, words)  # (W, width)
    rows, cols = model.fuser.grid_size
    out = {}
    with torch.no_grad():
        for w, word in enumerate(words):
            scores = model.fuser.finds(features[w].expand(len(patches), 1, -1), patches)[:, 0]  # (N, cells, H)
            if (rows, cols) != (3, 3):
                scores = cell_features(scores, (rows, cols))
            scores = scores.reshape(-1, scores.shape[-1])  # (N * 9, H)
            labels = (colours == 1 + COLOURS.index(word)) if word in COLOURS else (shapes == 1 + SHAPES.index(word))
            per_head = [binary_auroc(scores[:, h], labels.long()).item() for h in range(scores.shape[1])]
            best = int(np.argmax(per_head))
            out[word] = (per_head[best], best)
    return out


def query_cosines(model: VLFuseModel, first: str = "circle", second: str = "square") -> list[float]:
    """Per head: the cosine of the two words' find queries (after the QK-norm). A head that tells
    ``first`` from ``second`` gives them opposite queries; in the stalled runs of issue 38 every head
    gave a circle and a square nearly the same query (cosine 0.73 or more), the keys nearly the
    same keys, and neither could learn the difference without the other."""
    with torch.no_grad():
        queries = model.fuser.find_queries(word_features(model, [first, second]))  # (2, H, dh)
    return F.cosine_similarity(queries[0], queries[1], dim=-1).tolist()


def key_probes(model: VLFuseModel, patches: torch.Tensor, scenes) -> list[tuple[float, float]]:
    """Per head: held-out accuracy of a linear probe of its find key for each cell's (shape, colour)."""
    colours, shapes = cell_labels(scenes)
    with torch.no_grad():
        keys = model.fuser.find_keys(patches)  # (N, cells, H, dh)
    out = []
    for h in range(keys.shape[2]):
        cells = cell_features(keys[:, :, h], tuple(model.fuser.grid_size))  # (N * 9, dh)
        out.append((probe_accuracy(cells, shapes), probe_accuracy(cells, colours)))
    return out


def key_separation(model: VLFuseModel, patches: torch.Tensor, scenes, pair: tuple[str, str] = ("circle", "square")) -> list[float]:
    """Per head: how far its find keys tell the two shapes of ``pair`` apart, cells of the same colour
    compared: the squared Mahalanobis distance between the two shapes' mean keys (their pooled
    covariance, lightly regularised), averaged over the colours. A circle and a square differ only
    at their corners; a head whose keys tell them apart is far above the others (docs/results.md, issue 38)."""
    colours, shapes = cell_labels(scenes)
    first, second = (1 + SHAPES.index(shape) for shape in pair)
    with torch.no_grad():
        keys = model.fuser.find_keys(patches)  # (N, cells, H, dh)
    out = []
    for h in range(keys.shape[2]):
        cells = cell_features(keys[:, :, h], tuple(model.fuser.grid_size)).double()  # (N * 9, dh)
        distances = []
        for colour in range(1, 1 + len(COLOURS)):
            a, b = cells[(colours == colour) & (shapes == first)], cells[(colours == colour) & (shapes == second)]
            if min(len(a), len(b)) <= cells.shape[1]:
                continue  # too few cells of this colour for a covariance
            pooled = (torch.cov(a.T) * (len(a) - 1) + torch.cov(b.T) * (len(b) - 1)) / (len(a) + len(b) - 2)
            pooled = pooled + 1e-4 * pooled.diagonal().mean() * torch.eye(len(pooled), dtype=pooled.dtype)
            difference = a.mean(0) - b.mean(0)
            distances.append(float(difference @ torch.linalg.solve(pooled, difference)))
        out.append(float(np.mean(distances)) if distances else float("nan"))
    return out


def token_probe(model: VLFuseModel, patches: torch.Tensor, scenes) -> tuple[float, float]:
    """Held-out accuracy of a linear probe of the patch tokens for each cell's (shape, colour): what
    the keys could tell, before the key projection."""
    colours, shapes = cell_labels(scenes)
    cells = cell_features(patches, tuple(model.fuser.grid_size))  # (N * 9, d)
    return probe_accuracy(cells, shapes), probe_accuracy(cells, colours)


def relation_shifts(model: VLFuseModel, least: float = 0.01) -> dict[str, list[tuple[str, list[tuple[tuple[int, int], float]], float]]]:
    """Per relation (``cell_moves``), the shift of each word of its phrase as the reader reads it in
    "is a red shape right of a green shape": ``[(word, the moves it weights at least ``least``, most
    first, as ((rows, cols), weight), the weight of no move)]``. "of" comes in "left of" and "right
    of" both: read alone, it can only mix their moves."""
    steps = model.fuser.shift_steps()
    stay = steps.index((0, 0))
    out = {}
    for relation in RELATIONS:
        question = to_english(("is", "red", (relation, "green")))
        phrase = relation.removesuffix("_of").split("_") + (["of"] if relation.endswith("_of") else [])
        words = ["[CLS]"] + question.split()
        first = words.index(phrase[0], words.index("shape"))
        tokens = model.processor.tokenize([question])
        with torch.no_grad():
            text = model.encode_questions(tokens["input_ids"], tokens["attention_mask"])
            shifts = model.fuser.shifts(text)[0]  # (Lt, 9)
        out[relation] = []
        for offset, word in enumerate(phrase):
            p = shifts[first + offset]
            order = [int(k) for k in p.argsort(descending=True) if p[k] >= least]
            out[relation].append((word, [(steps[k], float(p[k])) for k in order], float(p[stay])))
    return out


def query_sets(query) -> list[tuple[int, object]]:
    """``(query word index, set expression)`` for every set a query's reader passes through, read
    last first: the innermost word, each relation around it, then the first argument's intersection
    (index 1, expression ``("and", A, B)``)."""
    _, first, second = query
    sets, index, expr = [], 2, second
    while True:
        sets.append((index, expr))
        if isinstance(expr, str):
            break
        expr, index = expr[1], index + 1
    return sets[::-1] + [(1, ("and", first, second))]


def set_tokens(query) -> list[tuple[int, int, object]]:
    """:func:`query_sets` as ``(query word index, token index, set expression)``: the token is the one
    whose reading completes the set, the first of the set's English (``[CLS]`` is token 0; the
    reader reads last first)."""
    phrases = english_phrases(query)
    first_token = 1 + np.cumsum([0] + [len(phrase.split()) for phrase in phrases])  # (words + 1,)
    return [(word, int(first_token[word]), expr) for word, expr in query_sets(query)]


def _denoted(expr, scene) -> np.ndarray:
    if isinstance(expr, tuple) and expr[0] == "and":
        return denotation(expr[1], scene) & denotation(expr[2], scene)
    return denotation(expr, scene)


def question_states(model: VLFuseModel, images: np.ndarray, queries: list, batch: int = 256) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The reader's soft sets as the model reads each question: yields ``(first row, states (B, Lt,
    cells), text mask (B, Lt))`` batch by batch, row t of a question's states once its token t is
    read (:meth:`~vlfuse.fusers.CellStepsFuser.states`), the words read through the model's own
    ``encode_questions``."""
    tokens = model.processor.tokenize([" ".join(english_phrases(q)) for q in queries])
    mask = tokens["attention_mask"].bool()
    for start in range(0, len(queries), batch):
        rows = slice(start, start + batch)
        patches = patches_of(model, images[rows])
        with torch.no_grad():
            text = model.encode_questions(tokens["input_ids"][rows], mask[rows].long())
            yield start, model.fuser.states(text, mask[rows], patches), mask[rows]  # states (B, Lt, cells)


def set_states(model: VLFuseModel, split: ShapesSplit, scenes, batch: int = 256) -> dict[tuple[str, str], list[float]]:
    """``{(pattern, part read): [questions, sum of mean m on the denoted cells, questions with any,
    sum of mean m elsewhere]}``; ``part read`` is the pattern's tail from that word on ("R1 C1")."""
    sums: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0, 0.0])
    for start, states, mask in question_states(model, split.images, split.queries, batch):
        for i in range(len(states)):
            text_query = split.queries[start + i]
            query, scene = parse_query(text_query), scenes[start + i]
            words = sum(len(phrase.split()) for phrase in english_phrases(query))
            if mask[i].sum() != words + 2:
                raise ValueError(f"the tokenizer does not read {text_query!r} one token per word")
            pattern = question_pattern(text_query).split()
            for word, token, expr in set_tokens(query):
                denoted = torch.from_numpy(_denoted(expr, scene).reshape(-1))
                m = states[i, token]
                entry = sums[(" ".join(pattern), " ".join(pattern[word:]))]
                entry[0] += 1
                if denoted.any():
                    entry[1] += m[denoted].mean().item()
                    entry[2] += 1
                entry[3] += m[~denoted].mean().item() if (~denoted).any() else 0.0
    return sums


def states_split(name: str, count: int) -> tuple[ShapesSplit, list]:
    """Images, queries and known scenes: the released val split (scenes read from the pixels, the
    unambiguous ones only) or new images of the training questions."""
    if name == "train":
        queries = distinct_queries(read_questions(find_shapes_dir(), TRAINING_QUESTIONS_SPLIT).queries)
        data = generate_training_set(queries, seed=1, images_per_question=max(1, count // len(queries)))
        return data, data.scenes
    data = load_released_split(find_shapes_dir(), "val")
    readings = read_scenes(data.images)
    keep = [i for i, reading in enumerate(readings) if reading.unambiguous][:count]
    split = ShapesSplit(data.images[keep], [data.queries[i] for i in keep], [data.answers[i] for i in keep])
    return split, [readings[i].scene for i in keep]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(parser)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--split", choices=("val", "train"), default="val", help="the questions the states read")
    parser.add_argument("--scenes", type=int, default=1000, help="generated scenes for the finds and keys")
    parser.add_argument("--questions", type=int, default=2000, help="at most this many questions for the states")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_model(args.model)
    reader = reader_of(model)
    if {"finds", "keys"} & set(args.parts):
        scenes, images = generated_scenes(args.scenes)
        patches = patches_of(model, images)
    if "finds" in args.parts:
        print(f"finds ({len(scenes)} generated scenes): word, the AUC of its best head against the cells holding it")
        for word, (best, head) in find_aucs(model, patches, scenes).items():
            print(f"  {word:9s} {best:.3f} (head {head})")
        cosines = query_cosines(model)
        print(f"  circle and square queries: cosine per head, median {np.median(cosines):.2f}, least {min(cosines):.2f}")
    if "keys" in args.parts:
        print("keys: head, a linear probe of its find key for the cell's shape / colour (held out); how far its keys "
              "put a circle from a square of the same colour (squared Mahalanobis distance)")
        shape, colour = token_probe(model, patches, scenes)
        print(f"  patch tokens (what every key is projected from)  shape {shape:.1%}  colour {colour:.1%}")
        separations = key_separation(model, patches, scenes)
        for head, (shape, colour) in enumerate(key_probes(model, patches, scenes)):
            print(f"  head {head:2d}  shape {shape:.1%}  colour {colour:.1%}  circle/square {separations[head]:.1f}")
    if "shifts" in args.parts:
        if isinstance(reader, CellMovesFuser):
            print("shifts: each word of a relation as read in \"is a red shape ... a green shape\": the moves it "
                  "weights (rows, cols) with their weights, most first; the weight of no move")
            for relation, words in relation_shifts(model).items():
                for word, moves, stay in words:
                    shown = "  ".join(f"{step} {weight:.3f}" for step, weight in moves)
                    print(f"  {relation:9s} {word:6s} {shown}  | no move {stay:.3f}")
        else:
            print("shifts: none (a cell_steps reader moves the set only through its update)")
    if "states" in args.parts:
        split, scene_list = states_split(args.split, args.questions)
        print(f"states ({args.split}, {len(split)} questions): pattern, the part read, mean m on the cells it "
              "denotes, mean m on the others")
        for (pattern, part), (n, inside, n_inside, outside) in sorted(set_states(model, split, scene_list).items()):
            shown = f"{inside / n_inside:.3f}" if n_inside else "  -  "
            print(f"  {pattern:18s} {part:16s} {shown}  {outside / n:.3f}  ({n} questions)")


if __name__ == "__main__":
    main()
