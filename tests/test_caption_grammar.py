"""The SHAPES caption grammar: writer and parser agree, and captions are checked against scenes."""

import numpy as np
import pytest

from vlfuse.captioning.grammar import (
    Sentence,
    describe,
    describe_sentences,
    fact_precision,
    object_recall,
    parse_caption,
)
from vlfuse.data.shapes import GRID, sample_scenes

from test_shapes import scene_of

ISSUE_EXAMPLE = (
    "a red square is left of a blue circle . a blue circle is above a green triangle . there is a green triangle ."
)
ISSUE_SCENE = scene_of("rs bc .", ". gt .", ". . .")


def object_count(scene) -> int:
    return sum(cell is not None for row in scene for cell in row)


def edge_scenes():
    """Scenes at the edges of the grammar: empty, full, one object in each cell."""
    yield scene_of(". . .", ". . .", ". . .")
    yield scene_of("rs gc bt", "bs rc gt", "gs bc rt")
    for row in range(GRID):
        for col in range(GRID):
            cells = [["." for _ in range(GRID)] for _ in range(GRID)]
            cells[row][col] = "gt"
            yield scene_of(*(" ".join(r) for r in cells))


def many_scenes():
    return [*edge_scenes(), *sample_scenes(3000, np.random.default_rng(20))]


def test_describe_writes_the_issue_example():
    assert describe(ISSUE_SCENE) == ISSUE_EXAMPLE


def test_describe_prefers_the_right_neighbour_then_the_one_below_then_there_is():
    scene = scene_of("rs bc .", "gt . .", ". . .")
    assert describe_sentences(scene) == [
        Sentence(("red", "square"), "left_of", ("blue", "circle")),  # right wins over below
        Sentence(("blue", "circle")),  # nothing right or below
        Sentence(("green", "triangle")),
    ]


def test_describe_looks_only_at_direct_neighbours():
    # the square's right neighbour is two cells away and the one below is diagonal
    assert describe(scene_of("rs . bc", ". gt .", ". . .")) == (
        "there is a red square . there is a blue circle . there is a green triangle ."
    )


def test_a_scene_without_objects_has_the_empty_caption_and_nothing_to_count():
    empty = scene_of(". . .", ". . .", ". . .")
    assert describe(empty) == ""
    assert parse_caption("") == []
    assert fact_precision("", empty) == (0, 0)
    assert object_recall("", empty) == (0, 0)


def test_describe_and_parse_caption_agree_on_generated_scenes():
    for scene in many_scenes():
        caption = describe(scene)
        sentences = parse_caption(caption)
        assert sentences == describe_sentences(scene)
        assert " ".join(s.text() for s in sentences) == caption
        assert len(sentences) == object_count(scene)


def test_every_described_caption_has_fact_precision_one_and_object_recall_one():
    for scene in many_scenes():
        caption = describe(scene)
        objects = object_count(scene)
        assert fact_precision(caption, scene) == (objects, objects)
        assert object_recall(caption, scene) == (objects, objects)


def test_parse_caption_names_the_sentence_that_is_not_in_the_grammar():
    with pytest.raises(ValueError, match=r"caption sentence 2 'there is a pink circle \.' is not in the grammar"):
        parse_caption("there is a red square . there is a pink circle .")
    with pytest.raises(ValueError, match=r"sentence 1 'a red square is near a blue circle \.'"):
        parse_caption("a red square is near a blue circle .")


def test_parse_caption_wants_every_sentence_to_end_with_a_period():
    with pytest.raises(ValueError, match=r"caption sentence 2 'there is a blue circle' .*must end with ' \.'"):
        parse_caption("there is a red square . there is a blue circle")


def test_fact_precision_counts_false_and_unparseable_sentences_as_false():
    caption = (
        "a red square is left of a blue circle ."  # true
        " a blue circle is left of a green triangle ."  # false: the triangle is below the circle
        " there is a pink square ."  # not in the grammar
        " there is a green triangle"  # no final period: not in the grammar
    )
    assert fact_precision(caption, ISSUE_SCENE) == (1, 4)


def test_relations_hold_only_between_direct_neighbours():
    assert fact_precision("a red square is left of a green triangle .", ISSUE_SCENE) == (0, 1)  # diagonal
    assert fact_precision("a red square is above a green triangle .", ISSUE_SCENE) == (0, 1)
    assert fact_precision("a blue circle is above a green triangle .", ISSUE_SCENE) == (1, 1)
    assert fact_precision("there is a blue circle . there is a red circle .", ISSUE_SCENE) == (1, 2)


def test_object_recall_counts_an_object_once_however_often_it_is_described():
    caption = "there is a red square . a red square is left of a blue circle . there is a red square ."
    assert object_recall(caption, ISSUE_SCENE) == (1, 3)


def test_object_recall_ignores_false_and_unparseable_sentences():
    caption = "there is a green square . a blue circle is left of a green triangle . there is a blue circle"
    assert object_recall(caption, ISSUE_SCENE) == (0, 3)


def test_object_recall_matches_each_sentence_to_an_object_that_makes_it_true():
    # Two red squares; only the first has a blue circle on its right. Matched greedily, "there is a
    # red square" would take the first square and leave the second sentence without an object.
    scene = scene_of("rs bc .", ". . .", ". . rs")
    caption = "there is a red square . a red square is left of a blue circle ."
    assert object_recall(caption, scene) == (2, 3)


def test_caption_errors_sorts_each_false_sentence_by_kind():
    from conftest import load_script
    from vlfuse.captioning.grammar import parse_leniently

    sentence_error = load_script("caption_errors").sentence_error
    caption = (
        "a red square is left of a blue circle . a red square is above a blue circle . "  # true; wrong neighbour
        "there is a red circle . a green circle is left of a red square . "  # no such subject, twice
        "a square is red ."  # not the grammar
    )
    kinds = [sentence_error(s, ISSUE_SCENE) for s in parse_leniently(caption)]
    assert kinds == [None, "wrong neighbour", "no such subject", "no such subject", "unparsed"]
