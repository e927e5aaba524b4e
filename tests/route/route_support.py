"""Helpers shared by the router tests (a uniquely named module, unlike `conftest`)."""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Callable

import numpy as np
import xxhash

from torchbridge.route.index import BlockIndex, block_hashes
from torchbridge.route.load_table import PoolState
from torchbridge.route.scorers import PickContext, RequestCtx


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


TOKENS = list(range(160))  # 10 blocks of 16
HASHES = block_hashes(TOKENS, 16)


def make_ctx(n: int = 4, session: str | None = None, **cols: list[float]) -> PickContext:
    """A pick context over n replicas r0.. whose load-table columns are set from `cols`."""
    pool = PoolState(capacity=n, default_prefill_tps=1000.0)
    for i in range(n):
        pool.add(f"r{i}")
    for k, v in cols.items():
        getattr(pool, k)[:n] = v
    return PickContext(RequestCtx(HASHES, len(TOKENS), 16, session), pool, BlockIndex(), BlockIndex(), {},
                       random.Random(0))


def mask(n: int = 4) -> np.ndarray:
    return np.ones(n, dtype=bool)


def assert_min_max_inverse(cls: type, col: str) -> None:
    """A load scorer over `col`: 1 for the least loaded, 0 for the most, linear between; all 1 when equal."""
    ctx = make_ctx(**{col: [0, 10, 5, 10]})
    assert cls("s").score(ctx, mask()).tolist() == [1.0, 0.0, 0.5, 0.0]
    flat = make_ctx(**{col: [3, 3, 3, 3]})
    assert cls("s").score(flat, mask()).tolist() == [1.0] * 4
