"""The question kinds of scripts/accuracy_by_question.py."""

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "accuracy_by_question.py"


def question_kind():
    spec = importlib.util.spec_from_file_location("accuracy_by_question", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.question_kind


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
