"""The question kinds of scripts/accuracy_by_question.py."""


import pytest

from conftest import load_script


def question_kind():
    return load_script("accuracy_by_question").question_kind


@pytest.mark.parametrize(
    "question, kind",
    [
        ("what color is the shape?", "what colour"),
        ("what is the color of the circle?", "what colour"),
        ("what is the blue shape?", "what shape"),
        ("what shape is present?", "what shape"),
        ("is there a red shape?", "yes/no colour"),
        ("is no teal shape present?", "yes/no colour negated"),
        ("does the image contain a circle?", "yes/no shape"),
        ("is there not a rectangle in the image?", "yes/no shape negated"),
    ],
)
def test_question_kinds(question, kind):
    assert question_kind()(question) == kind
