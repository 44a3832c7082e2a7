"""SHAPES (Andreas et al., "Neural Module Networks", 2016): queries, semantics, scenes, released files.

A scene is a 3x3 grid of 10x10-pixel cells on a black 30x30 canvas; each cell is empty or holds one
object (a shape in a colour). A query such as ``(is green (right_of blue))`` asks whether two sets
of cells intersect. This module holds, in plain Python and numpy:

- :func:`parse_query` / :func:`format_query`: S-expressions to nested tuples and back;
- :func:`denotation` / :func:`evaluate`: the dataset's semantics over a :data:`Scene`;
- :func:`to_english`: the dataset's own English form of a query;
- :func:`sample_scenes` / :func:`render_scenes` / :func:`generate_training_set`: the published scene
  generator, to regenerate training images that are not released;
- :func:`load_released_split` / :func:`read_questions`: the released ``<split>.query``,
  ``<split>.output`` and ``<split>.input.npy`` files, checked line by line;
- :func:`read_scenes` / :func:`read_scene`: recover the scene of a 30x30 image, with a margin for
  each cell, to check the evaluator against the released answers (:func:`evaluator_agreement`) and
  to caption released images.
"""

from __future__ import annotations

import logging
import re
import zlib
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple, Optional, Sequence, Union

import numpy as np

logger = logging.getLogger(__name__)

COLOURS = ("red", "green", "blue")
"""Colour words, in the RGB channel order of the images."""
SHAPES = ("circle", "square", "triangle")
RELATIONS = {"left_of": (0, -1), "right_of": (0, 1), "above": (-1, 0), "below": (1, 0)}
"""Relation word -> (row, column) step from a cell of the argument to a cell of the result."""
ANSWERS = ("false", "true")

GRID = 3
CELL = 10
IMAGE_SIZE = GRID * CELL
EMPTY_PROBABILITY = 0.2
RADII = (2.5, 3.75)
"""Small and large object radius in pixels, before the U(0.9, 1.1) size jitter."""
SIZE_JITTER = (0.9, 1.1)
COLOUR_JITTER = 0.2
"""Each channel of an object's colour is the pure colour plus U(-0.2, 0.2) of full scale, clipped."""
OFFICIAL_IMAGES_PER_QUESTION = 64
"""Images per training question in the released training sets; more is the 'extra data' variant."""

Query = Union[str, tuple]
"""A parsed query: a word (``"red"``) or a tuple ``(operator, *arguments)`` of parsed queries."""


class ShapeObject(NamedTuple):
    """One object of a scene."""

    shape: str
    colour: str


Scene = tuple[tuple[Optional[ShapeObject], ...], ...]
"""Three rows (top to bottom) of three cells (left to right), each an object or ``None``."""


def _where(source: str | Path | None, line: int | None) -> str:
    """``"file:line: "`` (or the parts that are known) to prefix an error message."""
    parts = [str(p) for p in (source, line) if p is not None]
    return ":".join(parts) + ": " if parts else ""


# --------------------------------------------------------------------------------------- queries


class _SyntaxProblem(Exception):
    """Internal: why a query does not parse; turned into a ValueError naming the file and line."""


_TOKEN = re.compile(r"\(|\)|[^\s()]+")


def _read_expression(tokens: list[str], i: int) -> tuple[Query, int]:
    """Read one word or bracketed list starting at ``tokens[i]``; return it and the next index."""
    if i >= len(tokens):
        raise _SyntaxProblem("unexpected end of query")
    if tokens[i] == ")":
        raise _SyntaxProblem("unexpected ')'")
    if tokens[i] != "(":
        return tokens[i], i + 1
    items: list[Query] = []
    i += 1
    while i < len(tokens) and tokens[i] != ")":
        item, i = _read_expression(tokens, i)
        items.append(item)
    if i >= len(tokens):
        raise _SyntaxProblem("missing ')'")
    return tuple(items), i + 1


def _check_set(expr: Query) -> None:
    """A set of cells: a colour or shape word, or ``(relation set)``."""
    if isinstance(expr, str):
        if expr not in COLOURS + SHAPES:
            known = ", ".join(COLOURS + SHAPES + tuple(RELATIONS) + ("is",))
            raise _SyntaxProblem(f"unknown or misplaced word {expr!r} (known words: {known})")
        return
    if not expr or expr[0] not in RELATIONS:
        raise _SyntaxProblem(f"expected a relation ({', '.join(RELATIONS)}) after '(', got {format_query(expr)!r}")
    if len(expr) != 2:
        raise _SyntaxProblem(f"{expr[0]} takes one argument, got {len(expr) - 1}")
    _check_set(expr[1])


def parse_query(text: str, *, source: str | Path | None = None, line: int | None = None) -> tuple:
    """Parse a SHAPES query ``(is A B)`` into nested tuples, e.g. ``("is", "green", ("right_of", "blue"))``.

    Args:
        text: the S-expression.
        source, line: where the text comes from, named in the error.

    Raises:
        ValueError: the query does not parse or uses an unknown word (names ``source:line``).
    """
    try:
        tokens = _TOKEN.findall(text)
        query, end = _read_expression(tokens, 0)
        if end != len(tokens):
            raise _SyntaxProblem(f"unexpected {' '.join(tokens[end:])!r} after the query")
        if isinstance(query, str) or len(query) != 3 or query[0] != "is":
            raise _SyntaxProblem("a query must be (is A B)")
        _check_set(query[1])
        _check_set(query[2])
    except _SyntaxProblem as problem:
        raise ValueError(f"{_where(source, line)}bad SHAPES query {text!r}: {problem}") from None
    return query


def format_query(query: Query) -> str:
    """The canonical S-expression of a parsed query (single spaces)."""
    if isinstance(query, str):
        return query
    return "(" + " ".join(format_query(q) for q in query) + ")"


def _parsed(query: Query) -> Query:
    """Parse ``query`` if it is an S-expression string, else return it as is."""
    return parse_query(query) if isinstance(query, str) else query


def query_words(query: Query) -> list[str]:
    """The words of a query in order, brackets dropped: ``['is', 'green', 'right_of', 'blue']``."""
    query = _parsed(query)
    return _TOKEN.findall(format_query(query).replace("(", " ").replace(")", " "))


def query_depth(query: Query) -> int:
    """Number of relation words in a query: 0 for ``(is red square)``, 2 for ``(is a (above (left_of b)))``."""
    return sum(word in RELATIONS for word in query_words(query))


def to_english(query: Query) -> str:
    """The dataset's English form of a query.

    Brackets are dropped; a colour word that is the third word stays a bare adjective, any other
    colour word becomes "a COLOUR shape", a shape word "a SHAPE", and ``_`` a space:
    ``(is green (right_of blue))`` -> "is a green shape right of a blue shape".
    """
    return " ".join(english_phrases(query))


def english_phrases(query: Query) -> list[str]:
    """:func:`to_english` one phrase per query word: ``['is', 'green', 'right of', 'a blue shape']``."""
    english = []
    for i, word in enumerate(query_words(query)):
        if word in COLOURS:
            english.append(word if i == 2 else f"a {word} shape")
        elif word in SHAPES:
            english.append(f"a {word}")
        else:
            english.append(word.replace("_", " "))
    return english


def question_pattern(question: str) -> str:
    """A question's pattern, its words replaced by their kind and numbered in order of first use:
    colours ``C``, shapes ``S``, relations ``R``.

    Takes the English form (what :class:`~vlfuse.callbacks.GroupAccuracy` gives) or the query:
    "is green right of right of a green shape" and ``(is green (right_of (right_of green)))`` are
    both ``is C1 R1 R1 C1``: one relation twice, and the colour it starts from asked for again. Use
    it as ``GroupAccuracy``'s ``group_of`` to log each pattern's val accuracy every epoch.
    """
    words = re.findall(r"[a-z]+", question.lower().replace("_of", ""))
    kinds = {**{w: "C" for w in COLOURS}, **{w: "S" for w in SHAPES}, **{r.removesuffix("_of"): "R" for r in RELATIONS}}
    numbered: dict[str, str] = {}
    pattern = ["is"]
    for word in words:
        kind = kinds.get(word)
        if kind is None:
            continue
        if word not in numbered:
            numbered[word] = f"{kind}{sum(v.startswith(kind) for v in numbered.values()) + 1}"
        pattern.append(numbered[word])
    return " ".join(pattern)


# ------------------------------------------------------------------------------------- semantics


def _shift(cells: np.ndarray, d_row: int, d_col: int) -> np.ndarray:
    """Move every True cell of a (3, 3) mask by (d_row, d_col); cells moved off the grid are dropped."""
    out = np.zeros_like(cells)
    rows, cols = cells.shape
    out[max(d_row, 0) : rows + min(d_row, 0), max(d_col, 0) : cols + min(d_col, 0)] = cells[
        max(-d_row, 0) : rows + min(-d_row, 0), max(-d_col, 0) : cols + min(-d_col, 0)
    ]
    return out


def denotation(expr: Query, scene: Scene) -> np.ndarray:
    """The cells (a (3, 3) boolean mask) that a set expression denotes in ``scene``.

    A colour or shape word denotes the cells holding an object of that colour or shape;
    ``(right_of X)`` the cells directly right of a cell of X (likewise left_of, above, below).
    """
    if isinstance(expr, str):
        return np.array([[obj is not None and expr in (obj.shape, obj.colour) for obj in row] for row in scene])
    relation, argument = expr
    return _shift(denotation(argument, scene), *RELATIONS[relation])


def evaluate(query: Query, scene: Scene) -> bool:
    """The answer to ``(is A B)`` in ``scene``: whether the sets A and B share a cell."""
    _, first, second = _parsed(query)
    return bool((denotation(first, scene) & denotation(second, scene)).any())


def answer_word(answer: bool) -> str:
    """``'true'`` or ``'false'``, the answer tokens of the dataset."""
    return ANSWERS[int(answer)]


# -------------------------------------------------------------------------------------- scenes


def sample_scenes(count: int, rng: np.random.Generator) -> list[Scene]:
    """Random scenes: each cell empty with probability 0.2, else a uniform shape in a uniform colour."""
    empty = rng.random((count, GRID, GRID)) < EMPTY_PROBABILITY
    shapes = rng.integers(len(SHAPES), size=(count, GRID, GRID))
    colours = rng.integers(len(COLOURS), size=(count, GRID, GRID))
    return [
        tuple(
            tuple(
                None if empty[n, row, col] else ShapeObject(SHAPES[shapes[n, row, col]], COLOURS[colours[n, row, col]])
                for col in range(GRID)
            )
            for row in range(GRID)
        )
        for n in range(count)
    ]


# Drawing follows the published generator (nmn2's data/gen_shapes.py at commit 1361644), which
# fills paths with cairo on a 30x30 surface; measured against the released images
# (scripts/shapes_renderer_match.py), its three ways of covering pixels are:
# - squares (a rectilinear path) are filled as boxes: each pixel gets its exact covered area;
# - triangles and circles go through cairo's scan converter, which samples 15 rows per pixel and
#   covers each sample row exactly between the outline's left and right edges;
# - a circle (cairo_arc over 0..2 pi) is two cubic Beziers of half a circle each (for radii under
#   about 5.4 px at cairo's default tolerance of 0.1 px), flattened into a polygon by halving
#   each curve until its control points lie within the tolerance of its chord.
_SUBROWS = 15
# Heights of the sample rows of one cell, relative to its centre (pixel centres at -4.5..4.5): (150,)
_ROW_Y = (np.arange(CELL * _SUBROWS) + 0.5) / _SUBROWS - CELL / 2
ARC_TOLERANCE = 0.1
"""Largest distance in pixels between a circle's Bezier curves and the polygon that fills them (cairo's default)."""
_FLATTEN_DEPTH = 8
"""Halvings of a half-circle curve considered; 3 suffice for the radii drawn (a radius below 54 px needs fewer than 8)."""


def _halve(curve: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split a cubic Bezier (4, 2) at t = 1/2 (de Casteljau) into its two halves."""
    ab, bc, cd = (curve[:-1] + curve[1:]) / 2
    abc, bcd = (ab + bc) / 2, (bc + cd) / 2
    middle = (abc + bcd) / 2
    return np.array([curve[0], ab, abc, middle]), np.array([middle, bcd, cd, curve[3]])


def _flatness(curve: np.ndarray) -> float:
    """Squared distance of a cubic's inner control points from the segment joining its ends (the larger)."""
    start, chord = curve[0], curve[3] - curve[0]
    length2 = chord @ chord
    worst = 0.0
    for point in curve[1:3]:
        offset = point - start
        along = np.clip(offset @ chord / length2, 0.0, 1.0) if length2 else 0.0
        offset = offset - along * chord
        worst = max(worst, float(offset @ offset))
    return worst


def _flatten(curve: np.ndarray, limit: float, depth: int = 0) -> list[np.ndarray]:
    """Start points of the segments that replace ``curve``: halve it until its flatness is below ``limit``."""
    if depth == _FLATTEN_DEPTH or _flatness(curve) < limit:
        return [curve[0]]
    first, second = _halve(curve)
    return _flatten(first, limit, depth + 1) + _flatten(second, limit, depth + 1)


# The lower half of the unit circle as cairo draws it, from angle 0 to pi (y grows downwards):
# control points at distance h = 4/3 tan(pi/4) along the tangents at its ends.
_HALF_CIRCLE = np.array([[1.0, 0.0], [1.0, 4.0 / 3.0], [-1.0, 4.0 / 3.0], [-1.0, 0.0]])


def _curve_flatness_by_depth() -> np.ndarray:
    """Flatness of every sub-curve of the unit half circle down to ``_FLATTEN_DEPTH`` halvings, sorted."""
    found, level = [], [_HALF_CIRCLE]
    for _ in range(_FLATTEN_DEPTH):
        found += [_flatness(curve) for curve in level]
        level = [half for curve in level for half in _halve(curve)]
    return np.unique(found)


_FLATNESS = _curve_flatness_by_depth()


@lru_cache(maxsize=None)
def _unit_circle_right_side(flatter_than: int) -> tuple[np.ndarray, np.ndarray]:
    """The right side of a flattened unit circle, top to bottom: (heights, half widths).

    A sub-curve is flat enough when its flatness is below ``(tolerance / radius)^2``, so the polygon
    depends on the radius only through how many of the sorted ``_FLATNESS`` values lie below that:
    ``flatter_than``. The polygon is then the one of any radius with the same count.
    """
    limit = _FLATNESS[flatter_than] if flatter_than < len(_FLATNESS) else np.inf
    lower = np.array(_flatten(_HALF_CIRCLE, limit) + [_HALF_CIRCLE[3]])  # from (1, 0) to (-1, 0)
    right = lower[lower[:, 0] >= 0]  # (1, 0) ... (0, 1)
    heights = np.concatenate([-right[::-1, 1], right[1:, 1]])  # the upper half mirrors the lower
    widths = np.concatenate([right[::-1, 0], right[1:, 0]])
    return heights, widths


def _circle_half_widths(radii: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Half widths (n, len(y)) of the flattened circles of ``radii`` at heights ``y`` from the centre."""
    half_widths = np.zeros((len(radii), len(y)))
    unit_limits = (ARC_TOLERANCE / radii) ** 2  # a curve is flat enough when its unit flatness is below this
    flatter_than = np.searchsorted(_FLATNESS, unit_limits)
    for key in np.unique(flatter_than):
        chosen = flatter_than == key
        heights, widths = _unit_circle_right_side(int(key))
        r = radii[chosen, None]
        half_widths[chosen] = r * np.interp(y[None, :] / r, heights, widths, left=0.0, right=0.0)
    return half_widths


def _centred_overlap(half_width: np.ndarray) -> np.ndarray:
    """Covered length of each pixel of a cell's row (last axis, 10) by [-half_width, half_width] about its centre.

    The pixel from ``k`` to ``k + 1`` right of the centre is covered over ``clip(half_width - k, 0, 1)``;
    the left half mirrors the right. ``half_width`` has any shape; a last axis of 10 is added.
    """
    right = np.clip(half_width[..., None] - np.arange(CELL // 2), 0.0, 1.0)
    return np.concatenate([right[..., ::-1], right], axis=-1)


def _coverage(shape: str, radii: np.ndarray) -> np.ndarray:
    """Share of each pixel of a cell covered by a shape centred in it, for each radius: (n, 10, 10).

    Circles have radius ``radius``, squares side ``2 * radius``; triangles point up, with the apex
    ``radius`` above the centre and a base ``2 * radius`` wide, ``radius`` below it. Pixels are
    covered as cairo covers them for the published generator (see the comment above).
    """
    radii = np.asarray(radii, dtype=np.float64)
    if shape == "square":
        side = _centred_overlap(radii)  # (n, 10), the same across and down
        return side[:, :, None] * side[:, None, :]
    r = radii[:, None]  # (n, 1)
    y = _ROW_Y[None, :]  # (1, 150), grows downwards
    if shape == "circle":
        half_width = _circle_half_widths(radii, _ROW_Y)
    else:
        half_width = np.where(y <= r, np.clip((y + r) / 2, 0.0, None), 0.0)
    # (n, 150) -> (n, 150, 10) -> (n, 10, 15, 10): average the 15 sample rows of each pixel row
    return _centred_overlap(half_width).reshape(-1, CELL, _SUBROWS, CELL).mean(axis=2)


def _draw_objects(objects: Sequence[ShapeObject], rng: np.random.Generator) -> np.ndarray:
    """Draw each object in its own cell with a random size and colour: float (n, 10, 10, 3) in [0, 1]."""
    size_class = np.asarray(RADII)[rng.integers(len(RADII), size=len(objects))]
    radii = size_class * rng.uniform(*SIZE_JITTER, size=len(objects))
    pure = np.eye(3)[[COLOURS.index(obj.colour) for obj in objects]]  # (n, 3)
    colours = np.clip(pure + rng.uniform(-COLOUR_JITTER, COLOUR_JITTER, size=pure.shape), 0.0, 1.0)
    coverage = np.zeros((len(objects), CELL, CELL))
    for shape in SHAPES:
        chosen = np.array([obj.shape == shape for obj in objects], dtype=bool)
        coverage[chosen] = _coverage(shape, radii[chosen])
    return coverage[..., None] * colours[:, None, None, :]


def render_scenes(scenes: Sequence[Scene], rng: np.random.Generator) -> np.ndarray:
    """Draw scenes on black canvases: RGB uint8 (N, 30, 30, 3).

    Each object gets a random size (small or large, radius 2.5 or 3.75 px, times U(0.9, 1.1)) and
    colour (its pure channel with U(-0.2, 0.2) jitter on every channel, clipped to [0, 1]), and is
    centred in its 10x10 cell.
    """
    where = [(n, r, c) for n, scene in enumerate(scenes) for r in range(GRID) for c in range(GRID) if scene[r][c]]
    cells = np.zeros((len(scenes), GRID, GRID, CELL, CELL, 3))  # (N, grid row, grid col, y, x, RGB)
    if where:
        n, row, col = np.array(where).T
        cells[n, row, col] = _draw_objects([scenes[i][r][c] for i, r, c in where], rng)
    # (N, grid row, grid col, y, x, 3) -> (N, grid row, y, grid col, x, 3) -> (N, 30, 30, 3)
    images = cells.transpose(0, 1, 3, 2, 4, 5).reshape(len(scenes), IMAGE_SIZE, IMAGE_SIZE, 3)
    return np.round(images * 255.0).astype(np.uint8)


# ------------------------------------------------------------------------------------ data sets


@dataclass
class ShapesSplit:
    """Aligned images, queries and answers of one SHAPES split (row i of each belongs together).

    Attributes:
        images: RGB uint8 (N, 30, 30, 3), or ``None`` where only questions are read.
        queries: canonical S-expressions.
        answers: ``'true'`` or ``'false'``.
        scenes: the scene of each image when it was generated here (empty for released files).
        skipped: bad rows left out (only with ``skip_bad_rows=True``).
    """

    images: Optional[np.ndarray]
    queries: list[str]
    answers: list[str]
    scenes: list[Scene] = field(default_factory=list)
    skipped: int = 0

    def __len__(self) -> int:
        return len(self.queries)


def _matching_scenes(first_argument: Query, count: int, rng: np.random.Generator) -> list[Scene]:
    """``count`` random scenes in which ``first_argument`` matches at least one object."""
    scenes: list[Scene] = []
    while len(scenes) < count:
        scenes += [scene for scene in sample_scenes(count, rng) if denotation(first_argument, scene).any()]
    return scenes[:count]


def generate_question_images(
    query: Query, count: int, rng: np.random.Generator
) -> tuple[np.ndarray, list[Scene], list[str]]:
    """``count`` images for one question, as the released training sets were made.

    Scenes are resampled until the question's first argument matches at least one object; the
    answer is then computed by :func:`evaluate`. Images are made in blocks of 64, one after the
    other from ``rng``, so asking for more images leaves the first blocks unchanged.

    Returns:
        images RGB uint8 (count, 30, 30, 3), their scenes, and the answers.
    """
    query = _parsed(query)
    images, scenes = [np.zeros((0, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)], []
    for start in range(0, count, OFFICIAL_IMAGES_PER_QUESTION):
        block = _matching_scenes(query[1], min(OFFICIAL_IMAGES_PER_QUESTION, count - start), rng)
        images.append(render_scenes(block, rng))
        scenes += block
    return np.concatenate(images), scenes, [answer_word(evaluate(query, scene)) for scene in scenes]


def generate_training_set(
    queries: Sequence[Query], *, seed: int = 0, images_per_question: int = OFFICIAL_IMAGES_PER_QUESTION
) -> ShapesSplit:
    """Generate a training set: ``images_per_question`` images for each query, question by question.

    ``images_per_question=64`` is the official protocol (the released train.large holds 64 images
    for each of its 212 questions). More images is the *extra data* variant: results trained on it
    are not comparable with published ones. Each question draws from its own random stream, seeded
    by ``seed`` and the question's text, so a question's images are the same whatever the other
    questions are, and its first 64 the same however many images per question are asked for.
    """
    if images_per_question < 1:
        raise ValueError(f"images_per_question must be at least 1, got {images_per_question}")
    if images_per_question != OFFICIAL_IMAGES_PER_QUESTION:
        logger.info(
            "SHAPES extra-data variant: %d images per training question (the official protocol has %d)",
            images_per_question,
            OFFICIAL_IMAGES_PER_QUESTION,
        )
    images, scenes, texts, answers = [], [], [], []
    for query in queries:
        text = format_query(_parsed(query))
        rng = np.random.default_rng([seed, zlib.crc32(text.encode())])
        question_images, question_scenes, question_answers = generate_question_images(query, images_per_question, rng)
        images.append(question_images)
        scenes += question_scenes
        answers += question_answers
        texts += [text] * images_per_question
    stacked = np.concatenate(images) if images else np.zeros((0, IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    return ShapesSplit(stacked, texts, answers, scenes)


# ------------------------------------------------------------------------------- released files


def _refuse_test(split: str) -> None:
    """The SHAPES test split is the project's held-out measure: it is never read."""
    if split.split(".")[0] == "test":
        raise ValueError("the SHAPES test split is held out and never read by this project; use 'val'")


def _read_lines(path: Path) -> list[str]:
    """The lines of a text file split at ``\\n`` only; the newline that ends the file starts no line."""
    if not path.is_file():
        raise FileNotFoundError(f"SHAPES file not found: {path}")
    lines = path.read_text(encoding="utf-8").split("\n")
    if lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r") for line in lines]


def read_questions(data_dir: str | Path, split: str, *, skip_bad_rows: bool = False) -> ShapesSplit:
    """Read ``<split>.query`` and ``<split>.output`` (no images; e.g. ``train.large``).

    Raises:
        ValueError: the two files have different line counts (names both files and counts), or,
            unless ``skip_bad_rows``, a query does not parse or an answer is not ``true``/``false``
            (names the file and line). With ``skip_bad_rows`` such rows are left out, counted in
            ``skipped`` and logged.
    """
    _refuse_test(split)
    return _read_rows(Path(data_dir), split, images=None, skip_bad_rows=skip_bad_rows)


def load_released_split(data_dir: str | Path, split: str, *, skip_bad_rows: bool = False) -> ShapesSplit:
    """Read a released split with images (``val``, ``train.small``, ``train.tiny``).

    ``<split>.input.npy`` holds uint8 (N, 30, 30, 3) images in **BGR** order; they are returned in
    RGB. Row counts must agree across the three files; see :func:`read_questions` for the checks.
    """
    _refuse_test(split)
    path = Path(data_dir) / f"{split}.input.npy"
    if not path.is_file():
        raise FileNotFoundError(f"SHAPES images not found: {path}")
    images = np.load(path)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise ValueError(f"{path}: expected uint8 images (N, 30, 30, 3), got {images.dtype} {images.shape}")
    return _read_rows(Path(data_dir), split, images=images[..., ::-1], skip_bad_rows=skip_bad_rows)


def _read_rows(data_dir: Path, split: str, images: Optional[np.ndarray], skip_bad_rows: bool) -> ShapesSplit:
    """Parse and align the rows of a split; see :func:`read_questions`."""
    query_path, output_path = data_dir / f"{split}.query", data_dir / f"{split}.output"
    query_lines, output_lines = _read_lines(query_path), _read_lines(output_path)
    if len(query_lines) != len(output_lines):
        raise ValueError(
            f"{query_path} has {len(query_lines)} lines but {output_path} has {len(output_lines)}: "
            "the rows cannot be aligned"
        )
    if images is not None and len(images) != len(query_lines):
        raise ValueError(
            f"{data_dir / f'{split}.input.npy'} has {len(images)} images but {query_path} has "
            f"{len(query_lines)} lines: the rows cannot be aligned"
        )
    kept, queries, answers = [], [], []
    for i, (query_line, output_line) in enumerate(zip(query_lines, output_lines)):
        try:
            query = format_query(parse_query(query_line, source=query_path, line=i + 1))
            answer = output_line.strip()
            if answer not in ANSWERS:
                raise ValueError(f"{output_path}:{i + 1}: bad answer {output_line!r}: expected 'true' or 'false'")
        except ValueError:
            if not skip_bad_rows:
                raise
            continue
        kept.append(i)
        queries.append(query)
        answers.append(answer)
    skipped = len(query_lines) - len(kept)
    if skipped:
        logger.warning("SHAPES %s: skipped %d bad rows of %d", split, skipped, len(query_lines))
    kept_images = None if images is None else np.ascontiguousarray(images[kept])
    return ShapesSplit(kept_images, queries, answers, skipped=skipped)


def distinct_queries(queries: Sequence[str]) -> list[str]:
    """The distinct queries in order of first appearance."""
    return list(dict.fromkeys(queries))


# --------------------------------------------------------------------------------- scene reader

EMPTY_BELOW = 0.3
"""A cell whose brightest channel stays below this share of full scale is empty (an object's colour has >= 0.8)."""
UNAMBIGUOUS_MARGIN = 0.5
"""Scene readings whose smallest cell margin is at least this are unambiguous (see :class:`SceneReading`)."""
_READ_RADII = np.arange(2.0, 4.5, 0.01)
"""Radii the reader tries for each shape (the generator draws 2.25-2.75 and 3.375-4.125 px)."""


@lru_cache(maxsize=1)
def _shape_templates() -> np.ndarray:
    """Each shape's coverage at every radius of ``_READ_RADII``, flattened and scaled to unit length: (3, R, 100)."""
    templates = np.stack([_coverage(shape, _READ_RADII).reshape(len(_READ_RADII), -1) for shape in SHAPES])
    return templates / np.linalg.norm(templates, axis=-1, keepdims=True)


@dataclass(frozen=True)
class SceneReading:
    """The scene read from one image, with how clear each cell's reading was.

    Attributes:
        scene: the cells as read.
        margins: (3, 3), in [0, 1]. An object's margin is the smaller of its colour's (1 minus the
            second channel's share of the dominant one, summed over the cell) and its shape's (1
            minus the ratio of the best shape's unexplained share of the cell to the runner-up's,
            each shape fitted at its best radius and brightness); an empty cell's is how far its
            brightest value lies below :data:`EMPTY_BELOW`, relative to it (an object's, how far
            above). 1 is a certain reading, 0 a tie.
    """

    scene: Scene
    margins: np.ndarray

    @property
    def margin(self) -> float:
        """The smallest cell margin."""
        return float(self.margins.min())

    @property
    def unambiguous(self) -> bool:
        """Whether every cell's margin is at least :data:`UNAMBIGUOUS_MARGIN`."""
        return self.margin >= UNAMBIGUOUS_MARGIN


def read_scenes(images: np.ndarray) -> list[SceneReading]:
    """Read the scenes of 30x30 RGB SHAPES images (released or generated): uint8 (N, 30, 30, 3).

    Each 10x10 cell is empty when its brightest channel stays below :data:`EMPTY_BELOW`; otherwise
    its colour is the channel with the largest sum, and its shape the one whose drawing (the
    generator's coverage at some radius, times a brightness) fits that channel best in least
    squares: a triangle has its mass low, a square fills its corners, a circle does neither.
    """
    images = np.asarray(images)
    if images.ndim != 4 or images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE, 3):
        raise ValueError(f"read_scenes expects RGB images (N, 30, 30, 3), got shape {images.shape}")
    # (N, 30, 30, 3) -> (N, 3, 3, 100, 3): the pixels of each cell
    cells = images.astype(np.float64).reshape(-1, GRID, CELL, GRID, CELL, 3).transpose(0, 1, 3, 2, 4, 5) / 255.0
    cells = cells.reshape(len(images), GRID, GRID, CELL * CELL, 3)
    brightest = cells.max(axis=(3, 4))  # (N, 3, 3)
    sums = np.sort(cells.sum(axis=3), axis=-1)  # (N, 3, 3, 3), ascending
    channel = cells.sum(axis=3).argmax(axis=-1)  # (N, 3, 3)
    colour_margin = 1.0 - sums[..., 1] / np.maximum(sums[..., 2], 1e-12)
    mask = np.take_along_axis(cells, channel[..., None, None], axis=-1)[..., 0]  # (N, 3, 3, 100)
    energy = np.maximum((mask**2).sum(axis=-1), 1e-12)
    fit = (np.einsum("nrcp,skp->nrcsk", mask, _shape_templates()) ** 2).max(axis=-1) / energy[..., None]
    unexplained = np.sort(1.0 - fit, axis=-1)  # (N, 3, 3, 3): each shape's share left unexplained, ascending
    shape = fit.argmax(axis=-1)
    shape_margin = 1.0 - unexplained[..., 0] / np.maximum(unexplained[..., 1], 1e-12)
    present = brightest >= EMPTY_BELOW
    presence_margin = np.minimum(np.abs(brightest - EMPTY_BELOW) / EMPTY_BELOW, 1.0)
    margins = np.where(present, np.minimum.reduce([colour_margin, shape_margin, presence_margin]), presence_margin)
    readings = []
    for n in range(len(images)):
        scene = tuple(
            tuple(
                ShapeObject(SHAPES[shape[n, row, col]], COLOURS[channel[n, row, col]]) if present[n, row, col] else None
                for col in range(GRID)
            )
            for row in range(GRID)
        )
        readings.append(SceneReading(scene, np.clip(margins[n], 0.0, 1.0)))
    return readings


def read_scene(image: np.ndarray) -> Scene:
    """Recover the scene of one 30x30 RGB SHAPES image (released or generated); see :func:`read_scenes`."""
    return read_scenes(np.asarray(image)[None])[0].scene


@dataclass
class Agreement:
    """How often the evaluator on recovered scenes gives the released answer."""

    agree: int
    total: int
    mismatches: list[int]
    """Row indices where they disagree."""
    ambiguous: list[int] = field(default_factory=list)
    """Row indices whose scene reading is not unambiguous (:attr:`SceneReading.unambiguous`)."""

    @property
    def rate(self) -> float:
        return self.agree / self.total if self.total else float("nan")


def evaluator_agreement(split: ShapesSplit) -> Agreement:
    """Evaluate every query on the scene read from its image and compare with the released answer."""
    if split.images is None:
        raise ValueError("evaluator_agreement needs images")
    readings = read_scenes(split.images)
    mismatches = [
        i
        for i, (reading, query, answer) in enumerate(zip(readings, split.queries, split.answers))
        if answer_word(evaluate(query, reading.scene)) != answer
    ]
    ambiguous = [i for i, reading in enumerate(readings) if not reading.unambiguous]
    return Agreement(len(split) - len(mismatches), len(split), mismatches, ambiguous)
