"""Redis stream entries as FastStream writes them, read with header lengths counted right
(FastStream 0.7.8 writes lengths in characters and bytes in UTF-8), and an entry FastStream
cannot read kept whole."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from faststream.redis.message import bDATA_KEY
from faststream.redis.parser.binary import BinaryMessageFormatV1

from ...kernel.escaping import as_str


def raw_entry(fields: Mapping[Any, Any]) -> bytes:
    """The bytes an unreadable stream entry carried: its ``__data__``, or all its fields."""
    data = fields.get(bDATA_KEY)
    if isinstance(data, bytes):
        return data
    return json.dumps({as_str(name): as_str(value) for name, value in fields.items()}).encode()


def utf8_headers(headers: Mapping[str, Any]) -> dict[Any, Any]:
    """Header names and text values as UTF-8 bytes (FastStream measures bytes correctly)."""
    return {
        name.encode(): value.encode() if isinstance(value, str) else value for name, value in headers.items()
    }


class Utf8BinaryMessageFormat(BinaryMessageFormatV1):
    """FastStream's binary format with header names and values written as UTF-8 bytes."""

    @classmethod
    async def encode(cls, *, headers: dict[str, Any] | None, **parts: Any) -> bytes:  # noqa: ANN401
        return await super().encode(headers=None if headers is None else utf8_headers(headers), **parts)
