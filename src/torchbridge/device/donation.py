"""Buffer donation: letting XLA update a storage's buffer in place instead of writing a new one.

Buffers are immutable, so a write into a storage makes a new buffer; for a large storage written a
few rows at a time (a KV cache) that copies the whole storage on every write. When the buffer table is
the only holder of the old buffer it can be donated to the program, and XLA reuses its memory. Eager
dispatch (`dispatch._Program.call`) and compiled graphs (`compile.backend`) both use this.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any

import jax

from torchbridge.device.runtime import STATE

DONATE_BYTES = 1 << 20  # smaller buffers are cheaper to copy than to reason about


def sole_holders(bufs: list, positions: Any, dev_index: int) -> list[int]:
    """Of `positions` in `bufs`, those whose buffer nothing but the table and `bufs` references.
    The device's completion markers (what synchronize() waits on: the last results, the last
    collective's) are dropped first if they hold one of them: the program that takes the buffer waits
    for it, and synchronize() waits for that program. Callers must not keep other references (loop
    variables)."""
    for markers, key in ((STATE.last_results, dev_index), (STATE.last_collective, STATE.jax_device(dev_index).id)):
        last = markers.get(key)
        if last is not None:
            held: set[int] = set()
            _ids(last, held)
            if any(id(bufs[k]) in held for k in positions):
                markers[key] = None
        last = None
    # references: the table, `bufs`, getrefcount's argument
    return [k for k in positions if sys.getrefcount(bufs[k]) <= 3]


def _ids(results: Any, into: set) -> None:
    """The ids of the arrays in a nest of tuples and lists (one pass, not one per position)."""
    if isinstance(results, (tuple, list)):
        for r in results:
            _ids(r, into)
    else:
        into.add(id(results))


def donating_jit(raw: Any, positions: tuple[int, ...]) -> Any:
    """`raw(bufs, *rest)` jitted to take the buffers at `positions` as its first argument, donated (in
    the order of `positions`), and the other buffers (in order) as its second: `fn(donated, others, *rest)`.

    JAX gives each output the first unused donated input of its shape and dtype, in order: list the
    donated buffers in the order their new values come out, or XLA pairs a buffer with another one's
    result (all of an optimizer's same-shaped arrays) and copies both to keep the old values."""
    return jax.jit(split_donated(raw, positions), donate_argnums=(0,), keep_unused=True)


def split_donated(raw: Any, positions: tuple[int, ...]) -> Any:
    """`raw(bufs, *rest)` as `fn(donated, others, *rest)` (donating_jit's argument order), not jitted."""
    def split(donated: tuple, others: tuple, *rest: Any) -> Any:
        return raw(merged(positions, donated, others), *rest)

    return split


def merged(positions: tuple[int, ...], donated: tuple, others: tuple) -> tuple:
    """The buffers in their original order, from `donating_jit`'s two groups."""
    where = {k: n for n, k in enumerate(positions)}
    oi = iter(others)
    return tuple(donated[where[k]] if k in where else next(oi) for k in range(len(donated) + len(others)))


def unless_copying(compiled: Any, donated_bytes: int, baseline: int | Callable[[], int] = 0) -> Any:
    """`compiled` (a donating program), or None where XLA kept the donated buffers' old values alive
    with copies of a quarter or more of their bytes: the program writing fresh buffers is then the
    faster one (RMSprop 29 vs 66 ms per step of 25M parameters, measured). `baseline`: the bytes the
    same program copies without donating (transposes XLA lays out as copies), which donation did not add;
    a callable is asked only when the donating program copies that much (it may compile the other
    program: the engine's every shape bucket paid a second XLA compile for it)."""
    copied = copied_bytes(compiled.as_text())
    if 4 * copied < donated_bytes:
        return compiled
    base = baseline() if callable(baseline) else baseline
    return None if 4 * (copied - base) >= donated_bytes else compiled


_COPY = re.compile(r"= (\w+)\[([\d,]*)\](?:\{[^}]*\})? copy\(")
_ITEM_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f16": 2, "bf16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
               "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16}


def copied_bytes(hlo_text: str) -> int:
    """Bytes the optimised HLO `copy` instructions move: what XLA added to keep a donated buffer's old
    value alive while its new value is written over it (one fusion recomputing another's output from
    the old value: RMSprop's parameter update re-deriving the new square average)."""
    total = 0
    for dtype, dims in _COPY.findall(hlo_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _ITEM_BYTES.get(dtype, 4)
    return total
