"""easy-VQA questions reworded in ways its training set never uses, with the same answers.

Each templated question is parsed into what it asks (the colour of the shape, which shape, or
whether a colour or shape is there, possibly negated), then written again with wording the 24
training templates do not have: synonyms ("picture", "figure", "can you see"), British spelling
("colour", "grey") and other word orders ("the triangle is which colour?"). A new user asks such
questions; a model that learnt only the templates does not understand them.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from vlfuse.data.easy_vqa import load_easy_vqa
from vlfuse.data.records import ImageQuestions

COLOURS = ("red", "green", "blue", "black", "gray", "yellow", "teal", "brown")
SHAPES = ("circle", "rectangle", "triangle")
_C, _S = "|".join(COLOURS), "|".join(SHAPES)
_BRITISH = {"gray": "grey"}


@dataclass(frozen=True)
class Asked:
    """What an easy-VQA question asks: ``kind`` colour / shape / exists; the ``colour`` or
    ``shape`` it names (if any); whether an existence question is ``negated``."""

    kind: str
    colour: str | None = None
    shape: str | None = None
    negated: bool = False


_PATTERNS = [
    (re.compile(rf"^what (?:color is|is the color of) the (?:shape|(?P<shape>{_S}))\?$"), "colour"),
    (re.compile(r"^what shape (?:is in the image|is present|does the image contain)\?$"), "shape"),
    (re.compile(rf"^what is the (?P<colour>{_C}) shape\?$"), "shape"),
    (
        re.compile(
            rf"^(?:is there (?P<not1>not )?a|does the image (?P<not2>not )?contain a|is (?:a|(?P<no>no)))"
            rf" (?:(?P<colour>{_C}) shape|(?P<shape>{_S}))(?: in the image| present)?\?$"
        ),
        "exists",
    ),
]


def parse_question(question: str) -> Asked:
    """What a templated easy-VQA question asks; ValueError for any other wording."""
    for pattern, kind in _PATTERNS:
        match = pattern.match(question)
        if match:
            groups = match.groupdict()
            negated = any(groups.get(name) for name in ("not1", "not2", "no"))
            return Asked(kind, groups.get("colour"), groups.get("shape"), negated)
    raise ValueError(f"not an easy-VQA template: {question!r}")


_COLOUR_OF = [
    "which colour is the {thing}?",
    "what colour does the {thing} have?",
    "the {thing} is which colour?",
    "tell me the colour of the {thing}.",
    "of what colour is the {thing}?",
    "which colour has the {thing} got?",
]
_WHICH_SHAPE = [
    "which shape can you see?",
    "what kind of shape is shown in the picture?",
    "which shape is drawn here?",
    "name the shape in the picture.",
    "the picture shows which shape?",
]
_WHICH_SHAPE_OF_COLOUR = [
    "which shape is {colour}?",
    "the {colour} figure is which shape?",
    "what kind of shape is the {colour} one?",
    "name the {colour} shape in the picture.",
]
_THERE = [
    "can you see a {thing}?",
    "does the picture show a {thing}?",
    "in the picture, is there a {thing}?",
    "is any {thing} shown?",
    "is a {thing} drawn in the picture?",
]
_NOT_THERE = [
    "is there no {thing} in the picture?",
    "is the picture without a {thing}?",
    "can you not see a {thing}?",
    "is it true that the picture has no {thing}?",
    "is a {thing} missing from the picture?",
]


def _thing(asked: Asked, rng: random.Random) -> str:
    if asked.shape:
        return asked.shape
    if asked.colour:
        return f"{_BRITISH.get(asked.colour, asked.colour)} {rng.choice(['shape', 'figure', 'object'])}"
    return rng.choice(["shape", "figure", "object"])


def reword(question: str, rng: random.Random) -> str:
    """``question`` (a templated easy-VQA question) asked another way, with the same answer."""
    asked = parse_question(question)
    thing = _thing(asked, rng)
    if asked.kind == "colour":
        return rng.choice(_COLOUR_OF).format(thing=thing)
    if asked.kind == "shape":
        if asked.colour is None:
            return rng.choice(_WHICH_SHAPE)
        return rng.choice(_WHICH_SHAPE_OF_COLOUR).format(colour=_BRITISH.get(asked.colour, asked.colour))
    return rng.choice(_NOT_THERE if asked.negated else _THERE).format(thing=thing)


def reworded_easy_vqa(split: str = "test", seed: int = 0) -> list[ImageQuestions]:
    """The ``split`` of easy-VQA with every question reworded (same images, same answers)."""
    rng = random.Random(seed)
    return [
        ImageQuestions(r.image, [reword(q, rng) for q in r.questions], list(r.answers), image_id=r.image_id)
        for r in load_easy_vqa(split)
    ]
