"""vlfuse.json_input.parse_json: strict JSON, every failure one JSONInputError (a ValueError) saying why."""

import pytest

from vlfuse.json_input import JSONInputError, parse_json


def test_json_values_and_utf8_bytes_parse_as_json_loads_does():
    assert parse_json('{"a": [1, 2.5, "x", null, true]}') == {"a": [1, 2.5, "x", None, True]}
    assert parse_json('"caf\u00e9"'.encode("utf-8")) == "caf\u00e9"
    assert parse_json("[1e-400]") == [0.0]  # underflows to zero, a float all the same


@pytest.mark.parametrize("text, why", [
    ("NaN", "NaN is not a JSON value"),
    ("[-Infinity]", "-Infinity is not a JSON value"),
    ('{"mlp_ratio": 1e400}', "1e400 is out of the range of a float"),
    ("[" + "9" * 5000 + "]", "an integer of more than 4300 digits"),
    ("[" * 100_000 + "]" * 100_000, "nested too deep"),
    (b"{\"a\": \"\xff\"}", "not UTF-8 text"),
    ('{"a": 1,}', "not valid JSON: .*line 1, column 9"),
])
def test_what_is_not_strict_json_is_one_json_input_error(text, why):
    with pytest.raises(JSONInputError, match=why) as caught:
        parse_json(text)
    assert isinstance(caught.value, ValueError) and "\n" not in str(caught.value)
