"""Eager programs whose large fresh outputs are written into spare buffers (storage.SPARES).

On JAX's CPU platform a program's output is new memory from the C allocator, page-faulted in on its
first write: an eager cross-entropy over a [512, 8192] float32 logits tensor wrote 32 MiB of new pages
per call (8,192 faults, 18.7 ms against CPU PyTorch's 3.5 ms, whose allocator reuses the freed block).
A program with an output of `storage.SPARE_MIN_BYTES` or more is called through `Recycling`: its first
call asks the pool to keep buffers of those outputs' shapes; later calls take the spares the pool has
and pass them as a first, donated argument that nothing reads, which XLA writes the outputs of the same
shape into. Compiled graphs (compile.backend) use the same `run`; collectives (distributed.collectives)
pass a spare of their one result the same way.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import jax

from torchbridge.device import donation, storage

COUNTERS: Counter[str] = Counter()  # "recycled_outputs": outputs written into spares, for tests and metrics
# variants per program, one per set of spares the pool had (each a compile of the program)
MAX_VARIANTS = 2


def wanted(shapes: list[tuple[tuple[int, ...], Any]], device: Any) -> bool:
    """Whether a program with outputs of these (shape, jax dtype) on `device` should recycle."""
    if not storage.spares_enabled(device):
        return False
    return any(_nbytes(shape, dtype) >= storage.SPARE_MIN_BYTES for shape, dtype in shapes)


def _nbytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * jax.numpy.dtype(dtype).itemsize


def run(program: Any, plain: Any, args: tuple, counters: Counter[str]) -> Any:
    """`plain(*args)` (a program writing no input) with its large fresh outputs in spare buffers, for as
    many of them as the pool has a spare for: the one loop compiled graphs (compile.backend) and eager ops share.
    `program.spare_keys`: its large outputs' pool keys (None before its first call);
    `program.recycling_keys(available)`: which of the available keys to use (empty: none);
    `program.recycling(args, keys, spares)`: the variant taking the spares as a donated first argument, or
    None where XLA would copy rather than write into them. Counted in counters["recycled_outputs"]."""
    if program.spare_keys:
        keys = program.recycling_keys(storage.SPARES.available(program.spare_keys))
        spares = storage.SPARES.take(list(keys)) if keys else None
        if spares:
            variant = program.recycling(args, keys, spares)
            if variant is not None:
                counters["recycled_outputs"] += len(spares)
                return variant(tuple(spares), *args)
            for buf in spares:
                storage.SPARES.put(buf)
    out = plain(*args)
    if program.spare_keys is None:
        program.spare_keys = [storage.SparePool.key(o.shape, o.dtype, d) for o in jax.tree.leaves(out)
                              if o.nbytes >= storage.SPARE_MIN_BYTES
                              and storage.spares_enabled(d := next(iter(o.devices())))]
        storage.SPARES.want(program.spare_keys)
    return out


class Recycling:
    """An eager program: `plain(*args)`, the jitted `raw`, through `run`."""

    def __init__(self, raw: Any, plain: Any) -> None:
        self.raw = raw
        self.plain = plain
        self.spare_keys: list[tuple] | None = None
        self._variants: dict[tuple, Any] = {}  # spare keys -> compiled program, None where XLA would copy

    def __call__(self, *args: Any) -> Any:
        return run(self, self.plain, args, COUNTERS)

    def recycling_keys(self, available: tuple) -> tuple:
        """All the spares there are, while the program has a variant for them or room for one more."""
        if available in self._variants or len(self._variants) < MAX_VARIANTS:
            return available
        return ()

    def recycling(self, args: tuple, keys: tuple, spares: list) -> Any:
        """The program with `spares` as a donated first argument: JAX pairs each with an output of its
        shape and XLA writes into it; None where XLA would copy a quarter of their bytes instead."""
        if keys not in self._variants:
            raw = self.raw
            compiled = jax.jit(lambda _spares, *a: raw(*a), donate_argnums=(0,), keep_unused=True).lower(
                tuple(spares), *args).compile()
            baseline = lambda: donation.copied_bytes(self.plain.lower(*args).compile().as_text())  # noqa: E731
            self._variants[keys] = donation.unless_copying(compiled, sum(b.nbytes for b in spares), baseline)
        return self._variants[keys]
