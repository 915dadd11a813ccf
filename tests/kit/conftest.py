"""The kit suite in parts: with ``KIT_SHARD=i/n`` a run keeps only the tests of part ``i`` of
``n`` (``tests/test_kit.py`` runs the parts side by side). A test's part is a hash of its node id,
not its file: the suite's time sits in a few files (every broker's variant of the same test), and
a split by file left one part twice as long as the others."""

from __future__ import annotations

import os
import zlib

import pytest


def part_of(node_id: str, parts: int) -> int:
    """The part a test belongs to: stable across runs, machines and Python versions."""
    return zlib.crc32(node_id.encode()) % parts


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = os.environ.get("KIT_SHARD")
    if not shard:
        return
    index, _, parts = shard.partition("/")
    if not (index.isdigit() and parts.isdigit() and int(index) < int(parts)):
        msg = f"KIT_SHARD={shard}: expected i/n with 0 <= i < n (the parts are 0/n to {parts}-1/n)"
        raise pytest.UsageError(msg)
    kept, other = [], []
    for item in items:
        (kept if part_of(item.nodeid, int(parts)) == int(index) else other).append(item)
    config.hook.pytest_deselected(items=other)
    items[:] = kept
