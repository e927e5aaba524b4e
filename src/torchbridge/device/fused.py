"""Fused eager mode: record ops, run each recorded sequence as one cached executable.

Plain eager dispatches one compiled program per op. In fused mode (`torchbridge.set_eager_mode("fused")`
or TORCHBRIDGE_EAGER_MODE=fused, see eager_mode.py) dispatch.run records the op's program and its inputs instead, and the
buffer table holds `Pending` placeholders for the results. Any read of a value (`.item()`, `.cpu()`,
`print`, a comparison used in Python control flow, CPU fallback, a compiled graph's inputs),
`synchronize()`, or reaching the size bound flushes: the recorded programs are traced together into
one jax.jit function (cached by the sequence of programs and how their buffers connect) and only the
results still referenced by live storages are returned, so XLA can fuse and drop the intermediates.
Each per-op program is a pure function of storage buffers, so composing them is exact: results are
the same values plain eager computes (up to XLA's fusion-level floating-point reassociation).

The size bound grows within a run of recording: after a read (the device has nothing queued) the first
FIRST_OPS ops flush, then twice as many, up to MAX_OPS. So the device starts computing soon after a read
while the host records the rest, instead of waiting for the whole run to be recorded (a Llama forward at
batch 1: 245 ops recorded in ~9 ms, then one ~30 ms program; everything serial). The bounds depend only on
the op count since the last read, so every iteration cuts the same sequences and reuses their programs.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import jax

MAX_OPS = int(os.environ.get("TORCHBRIDGE_FUSED_MAX_OPS", "256"))
FIRST_OPS = int(os.environ.get("TORCHBRIDGE_FUSED_FIRST_OPS", "16"))


class Pending:
    """A not-yet-computed buffer: output `out` of record `rec` in recording generation `gen`."""

    __slots__ = ("gen", "rec", "out", "shape", "dtype")

    def __init__(self, gen: int, rec: int, out: int, aval: Any) -> None:
        self.gen, self.rec, self.out = gen, rec, out
        self.shape, self.dtype = aval.shape, aval.dtype


class _Recorder:
    def __init__(self) -> None:
        self.gen = 0
        self.records: list[tuple[Any, tuple, tuple, tuple, tuple, int | None]] = []
        self.ext: list[Any] = []
        self.cache: dict[Any, Any] = {}
        self.lock = threading.RLock()
        self.flushes = 0
        self.ops_fused = 0
        self.last_outputs: Any = ()
        self.bound = FIRST_OPS  # the size bound of the sequence being recorded (never above MAX_OPS)

    def restart(self) -> None:
        """A read or synchronize() with nothing recorded: the next sequence starts small again, as after a read
        (else a read that follows a flush at the bound would leave the bound grown, and the next iteration
        would cut its sequences elsewhere and trace new programs)."""
        self.bound = FIRST_OPS

    def full(self) -> bool:
        """Whether the sequence being recorded has reached its size bound (the caller then flushes)."""
        return len(self.records) >= min(self.bound, MAX_OPS)

    def _ref(self, value: Any) -> tuple:
        if isinstance(value, Pending):
            if value.gen != self.gen:  # cannot happen: a flush resolves every Pending in the table
                raise RuntimeError("torchbridge: stale pending buffer")
            return ("p", value.rec, value.out)
        self.ext.append(value)
        return ("e", len(self.ext) - 1)

    def record(self, program: Any, bufs: tuple, scalars: tuple, hosts: tuple, host_scalars: tuple, rng: Any):
        with self.lock:
            avals = program.out_avals(bufs, scalars, hosts, host_scalars, rng)
            i = len(self.records)
            refs = tuple(self._ref(b) for b in bufs)
            groups = tuple(tuple(self._ref(v) for v in g) for g in (scalars, hosts, host_scalars))
            rng_ref = None if rng is None else self._ref(rng)
            self.records.append((program, refs, *groups, rng_ref))
            n_upd = len(program.writes)
            updated = tuple(Pending(self.gen, i, j, avals[0][j]) for j in range(n_upd))
            new = tuple(Pending(self.gen, i, n_upd + j, a) for j, a in enumerate(avals[1]))
            return updated, new

    def flush(self, table: dict[int, Any]) -> None:
        with self.lock:
            # a flush at the bound doubles the next one; any other (a read, synchronize) starts over small
            self.bound = min(self.bound * 2, MAX_OPS) if self.full() else FIRST_OPS
            if not self.records:
                return
            live = sorted({(v.rec, v.out) for v in table.values() if isinstance(v, Pending)})
            key = (tuple((id(r[0]), r[1:]) for r in self.records), tuple(live))
            fn = self.cache.get(key)
            if fn is None:
                # placed by its inputs; every recorded op's result rounded to its dtype, as plain eager's
                # (by default XLA may keep a bfloat16 value in float32 between fused ops)
                fn = jax.jit(_compose(list(self.records), live), keep_unused=True,
                             compiler_options={"xla_allow_excess_precision": False})
                self.cache[key] = fn
            outs = fn(tuple(self.ext))
            self.last_outputs = outs
            resolved = dict(zip(live, outs, strict=True))
            for k, v in list(table.items()):
                if isinstance(v, Pending):
                    table[k] = resolved[(v.rec, v.out)]
            self.flushes += 1
            self.ops_fused += len(self.records)
            self.records, self.ext = [], []
            self.gen += 1


def _compose(records: list, live: list[tuple[int, int]]):
    def fused(ext: tuple) -> tuple:
        vals: dict[tuple[int, int], Any] = {}

        def get(ref: tuple) -> Any:
            return ext[ref[1]] if ref[0] == "e" else vals[(ref[1], ref[2])]

        for i, (program, refs, scalars, hosts, host_scalars, rng_ref) in enumerate(records):
            updated, new = program.raw(
                tuple(get(r) for r in refs), tuple(get(r) for r in scalars), tuple(get(r) for r in hosts),
                tuple(get(r) for r in host_scalars), None if rng_ref is None else get(rng_ref),
            )
            for j, a in enumerate(tuple(updated) + tuple(new)):
                vals[(i, j)] = a
        return tuple(vals[k] for k in live)

    return fused


RECORDER = _Recorder()


def record_fast(program: Any, bufs: tuple, scalars: tuple, rng: Any) -> tuple[tuple, tuple, bool]:
    """The C++ fast path's way in (native.fast_call in fused mode): record a remembered call.
    Returns the placeholders of its (updated, new) buffers and whether the size bound says to flush
    once they are in the table."""
    updated, new = RECORDER.record(program, bufs, scalars, (), (), rng)
    return updated, new, RECORDER.full()


def stats() -> dict[str, int]:
    return {"flushes": RECORDER.flushes, "ops_fused": RECORDER.ops_fused, "fused_programs": len(RECORDER.cache),
            "pending_ops": len(RECORDER.records), "size_bound": min(RECORDER.bound, MAX_OPS)}
