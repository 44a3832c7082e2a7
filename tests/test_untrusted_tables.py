"""Tables from untrusted files (vlfuse.data.tables): a JSON Lines line that is not strict JSON, or
a CSV record the csv module refuses (a cell over its field size limit, a quoted cell not closed), is
a bad row whose one line names the file and the line, and the rows after it are still read; a .json
document that is not strict JSON is one line naming the file; a quoted CSV cell with a line break
is a good row."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from vlfuse.data.imagefolder import BadRowError, load_imagefolder_split
from vlfuse.data.tables import read_table

from test_data_forms import fit, imagefolder, refused
from test_imagefolder import write_split

LIMIT = csv.field_size_limit()
DEEP = "[" * 100_000 + "]" * 100_000
LONG_INTEGER = "1" * 5000


# ----------------------------------------------------------------------------------- JSON
# (a JSON Lines line that is not strict JSON: tests/test_imagefolder.py's BAD_ROWS)
def test_a_json_table_nested_too_deep_is_one_line_naming_the_file(tmp_path):
    for text, message in ((DEEP, "not usable JSON: nested too deep"), (f"[{LONG_INTEGER}]", "not usable JSON: an integer of more than")):
        path = tmp_path / "data.json"
        path.write_text(text)
        with pytest.raises(BadRowError, match=rf"^{path}: {message}") as error:
            read_table(path)
        assert "\n" not in str(error.value)


def test_an_answers_cell_nested_too_deep_is_not_a_list_of_answers(tmp_path):
    (tmp_path / "a.png").write_bytes(b"")  # never opened: the row is refused first
    path = tmp_path / "metadata.csv"
    path.write_text(f'file_name,question,answers\na.png,colour?,{"[" * 3000 + "]" * 3000}\n')
    with pytest.raises(BadRowError, match=rf"^{path}:2: 'answers' must be a non-empty list of answers") as caught:
        load_imagefolder_split(tmp_path)
    assert str(caught.value).endswith("... (6,002 characters)") and len(str(caught.value)) < 400  # the cell, cut


# ----------------------------------------------------------------------------------- CSV
def write_csv(folder: Path, lines: list[str]) -> Path:
    """A split of one red image ``a.png`` whose ``metadata.csv`` is ``lines`` after the header."""
    write_split(folder, [], {"a.png": "red"}).unlink()
    path = folder / "metadata.csv"
    path.write_text("file_name,question,answer\n" + "".join(line + "\n" for line in lines), newline="")
    return path


def questions(folder: Path) -> tuple[int, list[str]]:
    """What a split with ``skip_bad_rows`` keeps: the count of skipped rows and the questions."""
    loaded = load_imagefolder_split(folder, skip_bad_rows=True)
    return loaded.skipped, [q for record in loaded.records for q in record.questions]


def test_a_csv_cell_over_the_field_limit_is_a_bad_row_and_the_next_rows_are_read(tmp_path):
    path = write_csv(tmp_path, ["a.png,q1?,red", f"a.png,{'x' * (LIMIT + 1)},red", "a.png,q3?,red", "a.png,q4?,red"])
    with pytest.raises(BadRowError) as error:
        load_imagefolder_split(tmp_path)
    assert str(error.value) == f"{path}:3: a cell of more than {LIMIT} characters (the csv module's field size limit)"
    assert questions(tmp_path) == (1, ["q1?", "q3?", "q4?"])


def test_a_quoted_cell_over_the_field_limit_over_many_lines_names_where_it_opened(tmp_path):
    long_cell = "\n".join(["x" * 1000] * (LIMIT // 1000 + 5))
    path = write_csv(tmp_path, ["a.png,q1?,red", f'a.png,"{long_cell}",red', "a.png,q9?,red"])
    with pytest.raises(BadRowError) as error:
        load_imagefolder_split(tmp_path)
    message = str(error.value)
    assert message.startswith(f"{path}:3: a cell of more than {LIMIT} characters (the csv module's field size limit) on line ")
    assert message.endswith("; the quoted cell opened on line 3 ran on to it: is its closing quote missing?")
    skipped, kept = questions(tmp_path)  # the cell's other lines are read as rows, each a bad one
    assert kept == ["q1?", "q9?"] and skipped > 1


def test_a_quote_not_closed_before_the_end_of_the_file_names_its_line_and_keeps_the_rows_after_it(tmp_path):
    path = write_csv(tmp_path, ["a.png,q1?,red", 'a.png,"q2?,red', "a.png,q3?,red", "a.png,q4?,red"])
    with pytest.raises(BadRowError) as error:
        load_imagefolder_split(tmp_path)
    assert str(error.value) == f"{path}:3: a quoted cell is not closed before the end of the file (line 5)"
    assert questions(tmp_path) == (1, ["q1?", "q3?", "q4?"])


def test_a_stray_quote_closed_by_a_later_rows_quote_names_both_lines_and_keeps_the_rows_between(tmp_path):
    path = write_csv(tmp_path, ["a.png,q1?,red", 'a.png,"q2?,red', "a.png,q3?,red", 'a.png,"q4?",red', "a.png,q5?,red"])
    with pytest.raises(BadRowError) as error:
        load_imagefolder_split(tmp_path)
    assert str(error.value) == (
        f"{path}:3: text after a quoted cell's closing quote (',' expected after '\"'; a quote inside a quoted cell "
        "is written twice) on line 5; the quoted cell opened on line 3 ran on to it: is its closing quote missing?"
    )
    assert questions(tmp_path) == (1, ["q1?", "q3?", "q4?", "q5?"])


def test_a_quoted_cell_with_a_line_break_is_one_row_named_by_its_first_line(tmp_path):
    path = write_csv(tmp_path, ['a.png,"what colour\nis it?",red', 'a.png,"say ""red""",red', "gone.png,q?,red"])
    with pytest.raises(BadRowError, match=rf"^{path}:5: image file not found"):
        load_imagefolder_split(tmp_path)
    assert questions(tmp_path) == (1, ["what colour\nis it?", 'say "red"'])
    assert [where for where, _ in read_table(path).rows] == [f"{path}:2", f"{path}:4", f"{path}:5"]


def test_a_csv_header_the_reader_refuses_is_one_line_naming_line_1(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text(f'file_name,"question,answer\na.png,q?,red\n')
    with pytest.raises(BadRowError, match=rf"^{path}:1: a quoted cell is not closed before the end of the file \(line 2\)$"):
        read_table(path)


def huge_cell_in_train(root: Path) -> Path:
    """Split folders with a ``metadata.csv`` each; train's ends with a row whose question is over the field limit."""
    imagefolder(root, "metadata.csv")
    metadata = root / "train" / "metadata.csv"
    image = metadata.read_text().splitlines()[1].split(",")[0]
    with metadata.open("a", newline="") as f:
        f.write(f"{image},{'x' * (LIMIT + 1)},circle\n")
    return metadata


def test_fit_on_a_csv_with_a_huge_cell_stops_in_one_line_or_skips_it(tmp_path, capsys):
    metadata = huge_cell_in_train(tmp_path / "data")
    lines = len(metadata.read_text().splitlines())
    args = ("--data.init_args.data_dir", str(tmp_path / "data"))
    assert refused(tmp_path, capsys, *args) == (
        f"{metadata}:{lines}: a cell of more than {LIMIT} characters (the csv module's field size limit)"
    )
    assert fit(tmp_path, *args, "--data.init_args.skip_bad_rows", "true") == 0
    out, err = capsys.readouterr()
    assert "vlfuse: skipped 1 bad row of the train split" in err
    assert "vlfuse: test accuracy" in out


def test_any_other_error_of_the_csv_reader_is_a_bad_row_too(tmp_path, monkeypatch):
    """As Python before 3.11 refuses a NUL byte ("line contains NUL")."""
    reader = csv.reader

    def refusing_nul(lines, **options):
        def checked():
            for line in lines:
                if "\0" in line:
                    raise csv.Error("line contains NUL")
                yield line

        return reader(checked(), **options)

    monkeypatch.setattr(csv, "reader", refusing_nul)
    path = write_csv(tmp_path, ["a.png,q1?,red", "a.png,q\0?,red", "a.png,q3?,red"])
    with pytest.raises(BadRowError) as error:
        load_imagefolder_split(tmp_path)
    assert str(error.value) == f"{path}:3: not a CSV record (line contains NUL)"
    assert questions(tmp_path) == (1, ["q1?", "q3?"])
