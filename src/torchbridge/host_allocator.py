"""The host allocator policy `keep`: memory a step frees is kept for the next step (opt-in, process-wide).

glibc's malloc hands out blocks above its mmap threshold (128 KiB, rising by itself to at most 32 MiB)
as fresh mmap'd pages and unmaps them on free, trims its heap's free top back to the OS, and gives each
thread that allocates under contention an arena of its own, whose 64 MiB heaps it creates and deletes as
they fill and empty. A training step allocates the same MB-sized buffers (XLA:CPU's outputs and
temporaries, PyTorch's CPU tensors) every time, so under those defaults every step touches its buffers'
pages for the first time again: one page fault per 4 KiB, each a trap and a zeroed page. The compile
bench's Llama (15.7M parameters, batch 8 x 128) took 24,000-80,000 faults per training step on the
device and on PyTorch's CPU (~100-300 MB of fresh pages); `keep` takes them to about zero
(docs/benchmarks/compile.md, "Host allocator policy", for the steps' times).

`keep` does what the allocators PyTorch users preload for CPU work are set up to do (jemalloc or tcmalloc
with decay off): no mmap below 1 GiB, no trimming, one arena (threads share the main heap, so a block
the autograd thread frees is reused by the main thread's next step). The costs: the process keeps its
high-water mark instead of returning memory, and glibc's aligned allocations can strand freed blocks of
exactly the size asked again (a loop of one 64 MiB tensor grew to ~9 of them before they coalesced; the
collectives bench, every size from 1 KiB to 64 MiB in three arms, peaked at 1.5x the memory on 2 ranks
and was OOM-killed on 4; PyTorch's gloo all_gather of 64 MiB ran 4x slower under it). Training steps
keep their footprint (FSDP2 on 2 ranks: 3.2 GB peak with `keep`, 3.7 GB without).

It changes the whole process, so it is never turned on behind a user's back: TORCHBRIDGE_HOST_ALLOCATOR=keep
turns it on while `import torch` runs (_register.py), and `python -m torchbridge train` sets that default
for its own processes (cli.py). It must act before the process starts its threads, and does nothing on a
C library other than glibc.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings

# mallopt parameters (malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8

MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int: the largest, a free heap top of 2 GiB

_configured: bool | None = None


def configure() -> bool:
    """Apply the policy TORCHBRIDGE_HOST_ALLOCATOR names ('keep' or 'default', the default) once; True if
    `keep` is in effect."""
    global _configured
    if _configured is None:
        _configured = _apply()
    return _configured


def _apply() -> bool:
    policy = os.environ.get("TORCHBRIDGE_HOST_ALLOCATOR", "default")
    if policy not in ("keep", "default"):  # warn, never raise: this runs inside `import torch`
        warnings.warn(f"torchbridge: TORCHBRIDGE_HOST_ALLOCATOR must be 'keep' or 'default', not {policy!r}; "
                      "leaving glibc's defaults", stacklevel=2)
        return False
    libc = glibc() if policy == "keep" else None
    if libc is None:
        return False
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    # a glibc that refuses a threshold above half its arena heap size (32 MiB) gets the largest it takes
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 and libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) != 1:
        return False
    return libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1 and libc.mallopt(M_ARENA_MAX, 1) == 1


def glibc() -> ctypes.CDLL | None:
    """The process's C library if it is glibc on Linux, else None (another libc's mallopt means other things)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
    except (OSError, AttributeError):
        return None
    return libc


def state() -> str:
    """'keep' when the policy is in effect, else 'default' (for `torchbridge doctor`)."""
    return "keep" if _configured else "default"
