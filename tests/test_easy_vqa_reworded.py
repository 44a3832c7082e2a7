"""The reworded easy-VQA questions: same meaning and answers, wording the training set never uses."""

import random
import re
import subprocess
import sys

import pytest

from vlfuse.data.easy_vqa import load_easy_vqa
from vlfuse.data.easy_vqa_reworded import Asked, parse_question, reword, reworded_easy_vqa

from conftest import REPO


@pytest.mark.parametrize(
    "question, asked",
    [
        ("what is the color of the shape?", Asked("colour")),
        ("what color is the triangle?", Asked("colour", shape="triangle")),
        ("what shape does the image contain?", Asked("shape")),
        ("what is the teal shape?", Asked("shape", colour="teal")),
        ("is there not a gray shape in the image?", Asked("exists", colour="gray", negated=True)),
        ("is no circle present?", Asked("exists", shape="circle", negated=True)),
        ("does the image contain a rectangle?", Asked("exists", shape="rectangle")),
    ],
)
def test_templated_questions_parse_into_what_they_ask(question, asked):
    assert parse_question(question) == asked


def test_rewording_keeps_the_colour_or_shape_named_and_the_negation():
    rng = random.Random(0)
    assert "grey" in reword("is there a gray shape?", rng)  # British spelling
    negated = {reword("is there not a red shape?", rng) for _ in range(30)}
    affirmative = {reword("is there a red shape?", rng) for _ in range(30)}
    assert all("red" in q for q in negated | affirmative) and not negated & affirmative
    with pytest.raises(ValueError, match="not an easy-VQA template"):
        parse_question("how many shapes are there?")


def test_reworded_test_split_has_the_same_images_and_answers_and_no_training_wording():
    templated, reworded = load_easy_vqa("test"), reworded_easy_vqa("test", seed=0)
    assert [r.image for r in reworded] == [r.image for r in templated]
    assert [r.answers for r in reworded] == [r.answers for r in templated]
    training = {q for r in load_easy_vqa("train") for q in r.questions}
    reworded_questions = {q for r in reworded for q in r.questions}
    assert len(reworded_questions) > 200 and not reworded_questions & training


def test_reworded_accuracy_script_scores_both_wordings_by_kind():
    model = REPO / "tests" / "fixtures" / "format_v1" / "pool_gelu_leaky_relu" / "model"
    result = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "reworded_accuracy.py"), "--model", str(model), "--limit-images", "3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "| question kind | questions | templated | reworded |" in result.stdout
    assert re.search(r"^\| all \| \d+ \| \*\*[\d.]+%\*\* \| \*\*[\d.]+%\*\* \|$", result.stdout, re.M)
