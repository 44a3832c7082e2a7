"""JSON that a file or a user gave: parsed strictly, and every way it can fail is one ``ValueError``.

``json.loads`` alone lets through what is not JSON (``NaN``, ``Infinity``; ``1e400`` becomes
``inf``), and fails in ways that callers who catch :class:`json.JSONDecodeError` miss: a plain
``ValueError`` for an integer longer than Python's digit limit, a ``RecursionError`` for nesting
deeper than the interpreter's stack. :func:`parse_json` refuses all of them as :class:`JSONInputError`,
whose one-line message says what is wrong; the caller adds where (the file, the line).
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any


class JSONInputError(ValueError):
    """Text that is not strict JSON: the one-line message says why, not where."""


def _refuse_constant(name: str) -> None:
    raise JSONInputError(f"{name} is not a JSON value")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise JSONInputError(f"{text} is out of the range of a float")
    return value


def parse_json(text: str | bytes) -> Any:
    """The value of the JSON ``text`` (bytes are read as UTF-8).

    Raises:
        JSONInputError: bytes that are not UTF-8, text that is not JSON, ``NaN``/``Infinity``, a
            number beyond a float's range, an integer of more digits than Python converts, or
            nesting too deep to parse.
    """
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8")
        return json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except JSONInputError:
        raise
    except UnicodeDecodeError as err:
        raise JSONInputError(f"not UTF-8 text: {err.reason} at byte {err.start}") from None
    except json.JSONDecodeError as err:
        raise JSONInputError(f"not valid JSON: {err.msg} (line {err.lineno}, column {err.colno})") from None
    except ValueError:  # an integer past sys.get_int_max_str_digits()
        raise JSONInputError(f"not usable JSON: an integer of more than {sys.get_int_max_str_digits()} digits") from None
    except RecursionError:
        raise JSONInputError("not usable JSON: nested too deep") from None
