"""The ``--input`` JSONL of ``vlfuse predict`` is untrusted (vlfuse.inference.jsonl.read_rows): a
line that is not UTF-8 text, or not strict JSON (nested too deep, an integer of thousands of digits,
NaN), is an error row naming its line, and every other row is still answered."""

from __future__ import annotations

import json

import pytest

from test_predict import QUESTIONS, images, model_dir  # noqa: F401 (fixtures)
from vlfuse.cli import main as vlfuse_main
from vlfuse.inference.jsonl import read_rows

pytestmark = pytest.mark.usefixtures("one_thread")


def pairs_with_bad_lines(folder, image_name: str) -> bytes:
    """Lines 1 and 6 good; 2 nested too deep, 3 not UTF-8 (an image name with byte 0xff), 4 an
    integer of 5000 digits, 5 NaN."""
    good = json.dumps({"image": image_name, "question": QUESTIONS[0]}).encode()
    return b"\n".join([
        good,
        b"[" * 100_000 + b"]" * 100_000,
        b'{"image": "red\xff.png", "question": "what colour?"}',
        b'{"image": "0.png", "question": "how many?", "n": ' + b"1" * 5000 + b"}",
        b'{"image": "0.png", "question": "how many?", "n": NaN}',
        good,
    ]) + b"\n"


EXPECTED_ERRORS = {
    2: "not usable JSON: nested too deep",
    3: "not UTF-8 text: invalid start byte at byte 14",
    4: "not usable JSON: an integer of more than 4300 digits",
    5: "NaN is not a JSON value",
}


def test_lines_that_are_not_utf8_or_not_strict_json_are_error_rows(tmp_path):
    source = tmp_path / "pairs.jsonl"
    source.write_bytes(pairs_with_bad_lines(tmp_path, "0.png"))
    rows = read_rows(source)
    assert [row.line for row in rows] == [1, 2, 3, 4, 5, 6]
    for row in rows[1:5]:
        assert row.error.startswith(EXPECTED_ERRORS[row.line]), row.error
        assert row.image is None and row.fields == {}
    assert [row.image for row in (rows[0], rows[5])] == [tmp_path / "0.png"] * 2


def test_predict_answers_the_good_rows_around_lines_it_cannot_read(model_dir, images, tmp_path, capsys):
    source = images[0].parent / "pairs.jsonl"
    source.write_bytes(pairs_with_bad_lines(images[0].parent, images[0].name))
    output = tmp_path / "answers.jsonl"
    args = ["predict", "--model", str(model_dir), "--input", str(source), "--output", str(output)]
    assert vlfuse_main(args) == 1
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert [row["line"] for row in rows] == [1, 2, 3, 4, 5, 6]
    for row in rows[1:5]:
        assert row["error"].startswith(f"line {row['line']}: {EXPECTED_ERRORS[row['line']]}"), row["error"]
    assert [sorted(row) for row in (rows[0], rows[5])] == [["answer", "image", "line", "question", "score"]] * 2
    assert "4 of 6 rows failed (lines 2, 3, 4, 5)" in capsys.readouterr().err
