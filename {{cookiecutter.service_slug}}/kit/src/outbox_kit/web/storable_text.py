"""Refusing, before any route reads it, text no database stores alike: NUL, unpaired surrogates and
invalid UTF-8, wherever they are (path, query, a JSON or form body, keys included); and, in a JSON
body, numbers JSON has no finite value for: ``NaN``, ``Infinity``, ``-Infinity`` and literals
beyond the float range (``1e400``). Python's parser reads them (as nan and inf), so a model
would hold a value no JSON encoder writes back, and the 422 that echoed it failed with a 500.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qsl

from fastapi.responses import JSONResponse
from starlette.types import Scope

from ..kernel.text import is_storable, shorten

UNSTORABLE_MESSAGE = "NUL characters, unpaired surrogates and invalid UTF-8 are not accepted in text"
NON_FINITE_MESSAGE = (
    "non-finite numbers (NaN, Infinity, or beyond the float range such as 1e400) are not accepted"
)

_RISKY_ESCAPE = re.compile(r"\\u(?:0000|[dD][89a-fA-F][0-9a-fA-F]{2})")
# What a non-finite number needs: the words, an exponent of 3+ digits, or 200+ digits in a row
# (a 2-digit exponent reaches 1e308 only with 210+ integer digits). Only a body with one of these
# is parsed here a second time; a match inside a string is a false alarm the parse clears. The
# digit run matches only at its start: tried at every digit, a long run cost quadratic time.
_RISKY_NUMBER = re.compile(r"NaN|Infinity|[eE]\+?[0-9]{3}|(?<![0-9])[0-9]{200}")

Location = list[str | int]


class Refused(Exception):  # noqa: N818 (a control-flow signal carrying the answer)
    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


def unstorable(location: Location) -> Refused:
    error = {"type": "unstorable_text", "loc": location, "msg": UNSTORABLE_MESSAGE}
    return Refused(JSONResponse({"detail": [error]}, status_code=422))


def non_finite(location: Location) -> Refused:
    error = {"type": "non_finite_number", "loc": location, "msg": NON_FINITE_MESSAGE}
    return Refused(JSONResponse({"detail": [error]}, status_code=422))


class _NonFinite:
    """Stands, in the parsed document, for a number that has no finite value."""


_NON_FINITE = _NonFinite()


def _finite_or_marker(literal: str) -> float | _NonFinite:
    number = float(literal)
    return number if math.isfinite(number) else _NON_FINITE


def _refuse_unstorable_url(scope: Scope) -> None:
    if not is_storable(str(scope.get("path", ""))):
        raise unstorable(["path"])
    query: bytes = scope.get("query_string", b"")
    if b"%" in query:  # a NUL can only arrive percent-encoded
        _refuse_unstorable_pairs("query", query)


def _refuse_unstorable_pairs(where: str, encoded: bytes) -> None:
    for name, value in parse_qsl(encoded.decode("latin-1"), keep_blank_values=True):
        if not (is_storable(name) and is_storable(value)):
            raise unstorable([where, shorten(name)])


def _refuse_unstorable_body(content_type: str, body: bytes) -> None:
    media_type = content_type.partition(";")[0].strip().lower()
    if media_type == "application/json" or media_type.endswith("+json"):
        _refuse_unstorable_json(body)
    elif media_type == "application/x-www-form-urlencoded":
        _refuse_unstorable_pairs("body", body)


def _refuse_unstorable_json(body: bytes) -> None:
    try:
        # Strict UTF-8: JSON parsers decode with 'surrogatepass' and would let encoded surrogates in.
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise unstorable(["body"]) from None
    if not is_storable(text):
        raise unstorable(["body"])
    if _RISKY_ESCAPE.search(text) is None and _RISKY_NUMBER.search(text) is None:
        return
    try:
        document = json.loads(text, parse_constant=lambda _: _NON_FINITE, parse_float=_finite_or_marker)
    except (ValueError, RecursionError):
        return  # malformed JSON: the route's own parser answers it
    found = _first_refused(document)
    if found is not None:
        location, refusal = found
        raise refusal(["body", *location])


def _first_refused(document: Any) -> tuple[Location, Callable[[Location], Refused]] | None:  # noqa: ANN401
    """Where the first unstorable string (value or key) or non-finite number sits, and the
    refusal for it; iterative, so depth costs no stack."""
    stack: list[tuple[Location, Any]] = [([], document)]
    while stack:
        location, value = stack.pop()
        if isinstance(value, str):
            if not is_storable(value):
                return location, unstorable
        elif value is _NON_FINITE:
            return location, non_finite
        elif isinstance(value, dict):
            for key, item in value.items():
                if not is_storable(key):
                    return [*location, shorten(key)], unstorable
                stack.append(([*location, key], item))
        elif isinstance(value, list):
            stack.extend(([*location, index], item) for index, item in enumerate(value))
    return None
