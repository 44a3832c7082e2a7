"""The fixed caption grammar of SHAPES scenes: writer, parser and checks against the scene.

For each object in reading order (rows top to bottom, cells left to right), one sentence:

- ``a COLOUR SHAPE is left of a COLOUR SHAPE`` when the cell directly to its right holds an object;
- else ``a COLOUR SHAPE is above a COLOUR SHAPE`` when the cell directly below holds one;
- else ``there is a COLOUR SHAPE``.

Sentences end with ``" ."`` and are joined by a space:
``a red square is left of a blue circle . a blue circle is above a green triangle . there is a green triangle .``
A scene without objects is described by the empty caption ("").

A caption is checked against its scene (:func:`fact_precision`, :func:`object_recall`), so a
model's captions are scored on what they claim, not on how closely they copy the written ones.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

from vlfuse.data.shapes import COLOURS, GRID, SHAPES, Scene, ShapeObject

Thing = tuple[str, str]
"""``(colour, shape)``, e.g. ``("red", "square")``."""

RELATION_WORDS = {"left_of": ("left", "of"), "above": ("above",)}
"""Relation of a sentence -> its words between ``is`` and the object."""
_STEPS = {"left_of": (0, 1), "above": (1, 0)}
"""Relation -> (row, column) step from the subject's cell to the object's cell."""
END = "."


class Sentence(NamedTuple):
    """One sentence of a caption.

    Attributes:
        subject: ``(colour, shape)`` of the object the sentence is about.
        relation: ``"left_of"``, ``"above"`` or ``None`` (``there is a ...``).
        object: ``(colour, shape)`` of the neighbour, ``None`` when ``relation`` is ``None``.
    """

    subject: Thing
    relation: Optional[str] = None
    object: Optional[Thing] = None

    def text(self) -> str:
        """The sentence in the grammar, ending with ``" ."``."""
        if self.relation is None:
            return f"there is {_noun(self.subject)} {END}"
        return f"{_noun(self.subject)} is {' '.join(RELATION_WORDS[self.relation])} {_noun(self.object)} {END}"


def _noun(thing: Thing) -> str:
    colour, shape = thing
    return f"a {colour} {shape}"


def _thing(cell: ShapeObject) -> Thing:
    return (cell.colour, cell.shape)


def _cell(scene: Scene, row: int, col: int) -> Optional[ShapeObject]:
    """The object at (row, col), or ``None`` when the cell is empty or off the grid."""
    return scene[row][col] if 0 <= row < GRID and 0 <= col < GRID else None


# ---------------------------------------------------------------------------------------- writer


def describe_sentences(scene: Scene) -> list[Sentence]:
    """One :class:`Sentence` per object of ``scene``, in reading order (see the module docstring)."""
    sentences = []
    for row in range(GRID):
        for col in range(GRID):
            subject = scene[row][col]
            if subject is None:
                continue
            for relation, (d_row, d_col) in _STEPS.items():
                neighbour = _cell(scene, row + d_row, col + d_col)
                if neighbour is not None:
                    sentences.append(Sentence(_thing(subject), relation, _thing(neighbour)))
                    break
            else:
                sentences.append(Sentence(_thing(subject)))
    return sentences


def describe(scene: Scene) -> str:
    """The grammar's caption of ``scene`` ("" for a scene without objects)."""
    return " ".join(sentence.text() for sentence in describe_sentences(scene))


# ---------------------------------------------------------------------------------------- parser


def split_sentences(text: str) -> list[list[str]]:
    """The words of each sentence of ``text``, split at the ``"."`` words.

    Words after the last ``"."`` form a last sentence of their own (one that does not parse).
    """
    sentences: list[list[str]] = [[]]
    for word in text.split():
        sentences[-1].append(word)
        if word == END:
            sentences.append([])
    return sentences if sentences[-1] else sentences[:-1]


def _read_noun(words: Sequence[str]) -> Thing:
    """``["a", COLOUR, SHAPE]`` -> ``(COLOUR, SHAPE)``."""
    if len(words) != 3 or words[0] != "a" or words[1] not in COLOURS or words[2] not in SHAPES:
        raise ValueError(f"expected 'a COLOUR SHAPE' (colours: {', '.join(COLOURS)}; shapes: {', '.join(SHAPES)})")
    return (words[1], words[2])


def parse_sentence(words: Sequence[str]) -> Sentence:
    """Parse the words of one sentence (its final ``"."`` included).

    Raises:
        ValueError: the words are not a sentence of the grammar (says what was expected).
    """
    words = list(words)
    if not words or words[-1] != END:
        raise ValueError("a sentence must end with ' .'")
    words = words[:-1]
    if words[:2] == ["there", "is"]:
        return Sentence(_read_noun(words[2:]))
    for relation, relation_words in RELATION_WORDS.items():
        middle = ["is", *relation_words]
        if words[3 : 3 + len(middle)] == middle:
            return Sentence(_read_noun(words[:3]), relation, _read_noun(words[3 + len(middle) :]))
    raise ValueError("expected 'there is a C S .', 'a C S is left of a C S .' or 'a C S is above a C S .'")


def parse_caption(text: str) -> list[Sentence]:
    """Parse a caption of the grammar into its sentences ("" gives none).

    Raises:
        ValueError: a sentence is not in the grammar; the message names the sentence (counting
            from 1), quotes it and says what was expected.
    """
    sentences = []
    for number, words in enumerate(split_sentences(text), start=1):
        try:
            sentences.append(parse_sentence(words))
        except ValueError as problem:
            sentence = " ".join(words)
            raise ValueError(f"caption sentence {number} {sentence!r} is not in the grammar: {problem}") from None
    return sentences


def parse_leniently(text: str) -> list[Optional[Sentence]]:
    """Each sentence of ``text`` parsed, or ``None`` where it is not in the grammar."""
    parsed: list[Optional[Sentence]] = []
    for words in split_sentences(text):
        try:
            parsed.append(parse_sentence(words))
        except ValueError:
            parsed.append(None)
    return parsed


# ------------------------------------------------------------------------------ checks on scenes


def _objects(scene: Scene) -> list[tuple[int, int]]:
    """The (row, col) of every object, in reading order."""
    return [(row, col) for row in range(GRID) for col in range(GRID) if scene[row][col] is not None]


def witnesses(sentence: Sentence, scene: Scene) -> list[tuple[int, int]]:
    """The cells (reading order) whose object makes ``sentence`` true as its subject.

    For ``there is X``: every X. For ``X is left of Y`` (``above``): every X whose cell directly to
    the right (below) holds a Y. The sentence is true when the list is not empty.
    """
    found = []
    for row, col in _objects(scene):
        if _thing(scene[row][col]) != sentence.subject:
            continue
        if sentence.relation is not None:
            d_row, d_col = _STEPS[sentence.relation]
            neighbour = _cell(scene, row + d_row, col + d_col)
            if neighbour is None or _thing(neighbour) != sentence.object:
                continue
        found.append((row, col))
    return found


def fact_precision(caption: str, scene: Scene) -> tuple[int, int]:
    """``(true sentences, sentences)`` of ``caption`` about ``scene``.

    A sentence that does not parse counts as false (and as a sentence).
    """
    parsed = parse_leniently(caption)
    return sum(s is not None and bool(witnesses(s, scene)) for s in parsed), len(parsed)


def object_recall(caption: str, scene: Scene) -> tuple[int, int]:
    """``(objects described, objects)``: how many of the scene's objects are the subject of a true sentence.

    Each true sentence is matched to a distinct object that makes it true (one of its
    :func:`witnesses`), so that saying the same thing twice does not count two objects; the
    matching is a largest one (augmenting paths, trying objects in reading order), so the order of
    the sentences does not change the count.
    """
    candidates = [witnesses(s, scene) for s in parse_leniently(caption) if s is not None]
    owner: dict[tuple[int, int], int] = {}  # object cell -> index of the sentence matched to it

    def assign(sentence: int, tried: set) -> bool:
        for cell in candidates[sentence]:
            if cell in tried:
                continue
            tried.add(cell)
            if cell not in owner or assign(owner[cell], tried):
                owner[cell] = sentence
                return True
        return False

    for sentence in range(len(candidates)):
        assign(sentence, set())
    return len(owner), len(_objects(scene))
