"""How many threads XLA's CPU client runs programs on: TORCHBRIDGE_XLA_CPU_THREADS=N.

JAX has no setting for it. XLA sizes the CPU client's thread pools (the one that runs each program's
thunks and the intra-op pool its parallel loops and dots split over) by the CPUs the thread that starts the
client may run on (`sched_getaffinity`), so the device's start-up narrows its own thread to N of them while
JAX's backends start, and gives every thread they started all of its CPUs back afterwards: a pool keeps its
size, not the narrow mask. Unset, XLA sizes the pools by every CPU, as before.

Why it matters: PyTorch's own CPU ops follow `torch.set_num_threads` / OMP_NUM_THREADS, XLA's pools do not.
The serving engine on the device over the CPU platform with one torch thread (as the cpu engine runs) had
four XLA threads on a 2-core host, and the program's threads and the engine's Python thread kept taking each
other's core (~1,600 involuntary context switches a second). Fewer is not always faster: one thread per pool
made the bundled model's bf16 step 1.12x faster there and the bench model's fp32 step at 32 rows 0.86x
(docs/benchmarks/serve.md), so it is a setting. It applies when torchbridge starts JAX's backends; a process
that started them before (JAX used directly) keeps its pools.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

ENV = "TORCHBRIDGE_XLA_CPU_THREADS"


def requested() -> int | None:
    """The thread count asked for, or None (unset or empty: XLA's own sizing)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        n = int(raw)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{ENV} must be a positive number of threads, not {raw!r}")
    return n


def _threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@contextlib.contextmanager
def sized_pools() -> Iterator[None]:
    """Start JAX's backends inside this: with TORCHBRIDGE_XLA_CPU_THREADS=N (fewer than this thread's CPUs),
    the CPU client's pools get N threads each. Elsewhere (no such setting, no per-thread affinity) nothing."""
    n = requested()
    if n is None or not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        yield
        return
    cpus = os.sched_getaffinity(0)
    if n >= len(cpus):
        yield
        return
    before = _threads()
    os.sched_setaffinity(0, set(sorted(cpus)[:n]))
    try:
        yield
    finally:
        os.sched_setaffinity(0, cpus)
        for tid in _threads() - before:  # (started narrowed: a thread keeps the mask it was created with)
            with contextlib.suppress(OSError):  # (a thread that has ended since)
                os.sched_setaffinity(int(tid), cpus)
