"""vlfuse.analysis.tables.markdown_table: header, alignment, number formats, missing cells, escaping."""

import math

import numpy as np
import pytest

from vlfuse.analysis.tables import markdown_table


def test_numbers_are_formatted_per_column_and_numeric_columns_align_right():
    table = markdown_table(
        ["model", "heads", "ms", "speed-up", "share"],
        [["unpruned", 16, 12.345, 1.0, 0.5], ["half", 8, 7.5, 1.646, 0.25]],
        formats=[None, None, "{:.1f}", "{:.2f}x", "{:.0%}"],
    )
    assert table.splitlines() == [
        "| model | heads | ms | speed-up | share |",
        "|:---|---:|---:|---:|---:|",
        "| unpruned | 16 | 12.3 | 1.00x | 50% |",
        "| half | 8 | 7.5 | 1.65x | 25% |",
    ]


def test_none_is_missing_nan_is_undefined_and_neither_makes_a_column_textual():
    table = markdown_table(["a", "b"], [[None, math.nan], [1.5, np.float32("nan")], [2.0, np.float64(0.25)]],
                           formats="{:.2f}")
    assert table.splitlines()[1:] == ["|---:|---:|", "| - | n/a |", "| 1.50 | n/a |", "| 2.00 | 0.25 |"]


def test_a_column_with_any_text_aligns_left_and_explicit_alignment_wins():
    rows = [[0, "x"], ["all", "y"]]
    assert markdown_table(["depth", "v"], rows).splitlines()[1] == "|:---|:---|"
    assert markdown_table(["depth", "v"], rows, align="rc").splitlines()[1] == "|---:|:---:|"


def test_pipes_in_cells_and_titles_are_escaped_and_booleans_are_text():
    table = markdown_table(["a|b", "flag"], [["x | y", True]])
    assert table.splitlines() == ["| a\\|b | flag |", "|:---|:---|", "| x \\| y | True |"]


def test_rows_as_mappings_take_the_cells_of_the_header_keys_in_header_order():
    rows = [{"ms": 1.25, "name": "dense", "unused": 0}, {"name": "local", "ms": None}]
    table = markdown_table({"name": "contender", "ms": "ms (median)"}, rows, formats=[None, "{:.1f}"])
    assert table.splitlines() == ["| contender | ms (median) |", "|:---|---:|", "| dense | 1.2 |", "| local | - |"]


def test_a_table_without_rows_is_its_header():
    assert markdown_table(["", "before"], []) == "|  | before |\n|---:|---:|"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(rows=[[1]]), "row 0 has 1 cells for 2 columns"),
        (dict(rows=[[1, 2]], formats=["{}"]), "formats has 1 entries for 2 columns"),
        (dict(rows=[[1, 2]], align="r"), "align must be one of l, r, c per column \\(2\\), got 'r'"),
        (dict(rows=[[1, 2]], align="rx"), "got 'rx'"),
    ],
)
def test_misshapen_tables_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        markdown_table(["a", "b"], **kwargs)
