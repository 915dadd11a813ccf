"""Refusing, before any route reads it, text no database stores alike: NUL, unpaired surrogates and
invalid UTF-8, wherever they are (path, query, a JSON or form body, keys included)."""

from __future__ import annotations

import json
import re
from typing import Any
from urllib.parse import parse_qsl

from fastapi.responses import JSONResponse
from starlette.types import Scope

from ..kernel.text import is_storable, shorten

UNSTORABLE_MESSAGE = "NUL characters, unpaired surrogates and invalid UTF-8 are not accepted in text"

_RISKY_ESCAPE = re.compile(r"\\u(?:0000|[dD][89a-fA-F][0-9a-fA-F]{2})")

Location = list[str | int]


class Refused(Exception):  # noqa: N818 (a control-flow signal carrying the answer)
    def __init__(self, response: JSONResponse) -> None:
        super().__init__(response.status_code)
        self.response = response


def unstorable(location: Location) -> Refused:
    error = {"type": "unstorable_text", "loc": location, "msg": UNSTORABLE_MESSAGE}
    return Refused(JSONResponse({"detail": [error]}, status_code=422))


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
    if _RISKY_ESCAPE.search(text) is None:
        return
    try:
        document = json.loads(text)
    except (ValueError, RecursionError):
        return  # malformed JSON: the route's own parser answers it
    location = _first_unstorable(document)
    if location is not None:
        raise unstorable(["body", *location])


def _first_unstorable(document: Any) -> Location | None:  # noqa: ANN401 (any JSON value)
    """Where the first unstorable string (value or key) sits; iterative, so depth costs no stack."""
    stack: list[tuple[Location, Any]] = [([], document)]
    while stack:
        location, value = stack.pop()
        if isinstance(value, str):
            if not is_storable(value):
                return location
        elif isinstance(value, dict):
            for key, item in value.items():
                if not is_storable(key):
                    return [*location, shorten(key)]
                stack.append(([*location, key], item))
        elif isinstance(value, list):
            stack.extend(([*location, index], item) for index, item in enumerate(value))
    return None
