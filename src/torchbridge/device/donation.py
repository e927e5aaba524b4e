"""Buffer donation: letting XLA update a storage's buffer in place instead of writing a new one.

Buffers are immutable, so a write into a storage makes a new buffer; for a large storage written a
few rows at a time (a KV cache) that copies the whole storage on every write. When the buffer table is
the only holder of the old buffer it can be donated to the program, and XLA reuses its memory. Eager
dispatch (`dispatch._Program.call`) and compiled graphs (`compile.backend`) both use this.
"""

from __future__ import annotations

import sys
from typing import Any

import jax

from torchbridge.device.runtime import STATE

DONATE_BYTES = 1 << 20  # smaller buffers are cheaper to copy than to reason about


def sole_holders(bufs: list, positions: Any, dev_index: int) -> list[int]:
    """Of `positions` in `bufs`, those whose buffer nothing but the table and `bufs` references.
    The device's completion marker (what synchronize() waits on) is dropped first if it holds one of
    them: newer results replace it anyway. Callers must not keep other references (loop variables)."""
    last = STATE.last_results.get(dev_index)
    if last is not None and any(_holds(last, bufs[k]) for k in positions):
        STATE.last_results[dev_index] = None
    last = None
    # references: the table, `bufs`, getrefcount's argument
    return [k for k in positions if sys.getrefcount(bufs[k]) <= 3]


def _holds(results: Any, buf: Any) -> bool:
    if isinstance(results, (tuple, list)):
        return any(_holds(r, buf) for r in results)
    return results is buf


def donating_jit(raw: Any, positions: tuple[int, ...]) -> Any:
    """`raw(bufs, *rest)` jitted to take the buffers at `positions` as its first argument, donated, and
    the other buffers (in order) as its second: `fn(donated, others, *rest)`."""
    chosen = set(positions)

    def split(donated: tuple, others: tuple, *rest: Any) -> Any:
        di, oi = iter(donated), iter(others)
        return raw(tuple(next(di) if k in chosen else next(oi) for k in range(len(donated) + len(others))), *rest)

    return jax.jit(split, donate_argnums=(0,), keep_unused=True)
