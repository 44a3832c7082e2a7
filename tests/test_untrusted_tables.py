"""Tables from untrusted files (vlfuse.data.tables): a JSON Lines line that is not strict JSON is a
bad row whose one line names the file and the line, and the rows after it are still read; a .json
document that is not is one line naming the file."""

from __future__ import annotations

import pytest

from vlfuse.data.imagefolder import BadRowError, load_imagefolder_split
from vlfuse.data.tables import read_table

from test_imagefolder import split_with_bad_row

DEEP = "[" * 100_000 + "]" * 100_000
LONG_INTEGER = "1" * 5000

NOT_STRICT_JSON = {
    "nested too deep": (DEEP, r"not usable JSON: nested too deep$"),
    "integer of 5000 digits": (
        f'{{"file_name": "a.png", "question": "q?", "answer": "x", "n": {LONG_INTEGER}}}',
        r"not usable JSON: Exceeds the limit \(4300 digits\)",
    ),
    "NaN": ('{"file_name": "a.png", "question": "q?", "answer": NaN}', r"NaN is not a JSON value$"),
    "malformed, at a column": ('{"file_name": "a.png" "question": "q?"}', r"not valid JSON: Expecting ',' delimiter \(column 23\)$"),
}


# ----------------------------------------------------------------------------------- JSON Lines
@pytest.mark.parametrize("case", list(NOT_STRICT_JSON))
def test_a_jsonl_line_that_is_not_strict_json_is_a_bad_row_naming_file_and_line(tmp_path, case):
    line, message = NOT_STRICT_JSON[case]
    metadata = split_with_bad_row(tmp_path, line)
    with pytest.raises(BadRowError, match=rf"^{metadata}:3: {message}") as error:
        load_imagefolder_split(tmp_path)
    assert "\n" not in str(error.value)
    loaded = load_imagefolder_split(tmp_path, skip_bad_rows=True)
    assert loaded.skipped == 1
    assert [len(r.questions) for r in loaded.records] == [3]


def test_a_json_table_nested_too_deep_is_one_line_naming_the_file(tmp_path):
    for text, message in ((DEEP, "not usable JSON: nested too deep"), (f"[{LONG_INTEGER}]", "not usable JSON: Exceeds")):
        path = tmp_path / "data.json"
        path.write_text(text)
        with pytest.raises(BadRowError, match=rf"^{path}: {message}") as error:
            read_table(path)
        assert "\n" not in str(error.value)


def test_an_answers_cell_nested_too_deep_is_not_a_list_of_answers(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")  # never opened: the row is refused first
    path = tmp_path / "metadata.csv"
    path.write_text(f'file_name,question,answers\na.png,colour?,{"[" * 3000 + "]" * 3000}\n')
    with pytest.raises(BadRowError, match=rf"^{path}:2: 'answers' must be a non-empty list of answers"):
        load_imagefolder_split(tmp_path)
