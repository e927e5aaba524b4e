"""Helpers shared by the router tests (a uniquely named module, unlike `conftest`)."""

from __future__ import annotations

import struct
import time
from collections.abc import Callable

import xxhash


def reference_chain(tokens: list[int], bs: int) -> list[int]:
    """Independent restatement of the documented scheme: h_i = xxh64(le64(h_{i-1}) || le32 tokens)."""
    out, parent = [], 0
    for i in range(len(tokens) // bs):
        blob = struct.pack("<Q", parent) + struct.pack(f"<{bs}i", *tokens[i * bs:(i + 1) * bs])
        parent = xxhash.xxh64(blob).intdigest()
        out.append(parent)
    return out


def wait_for(cond: Callable[[], bool], timeout: float = 10.0, what: str = "condition") -> None:
    """Poll until cond() holds (a bounded loop for background state; not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
