"""Collectives as XLA collectives: each one a cached, jitted `shard_map` program over a group's mesh.

Every rank hands in its local block (a flat 1-d array on its chip); the block becomes its shard of a
global array sharded over the mesh axis, one program runs on every rank's chip (psum, all_gather,
psum_scatter, all_to_all, ppermute), and each rank takes its own shard of the result. On TPU the
program's collectives run over ICI; on JAX's CPU platform over its gloo transport. Programs are keyed
by the mesh, the block's shape and dtype, and the static arguments, so a training loop compiles each
collective once.

Reductions JAX has (sum, max, min) are one psum/pmax/pmin; the rest (product, bitwise) all-gather and
reduce locally. Broadcast and scatter move bits, never add them (a float -0.0 or NaN payload arrives
unchanged).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from torchbridge.device import storage
from torchbridge.device.runtime import STATE, run_collective
from torchbridge.distributed.mesh import AXIS

REDUCE_OPS = ("sum", "avg", "premul_sum", "max", "min", "product", "band", "bor", "bxor")
_programs: dict[Any, Any] = {}
# results written into spare buffers (`_run`), for tests and metrics
COUNTERS: Counter[str] = Counter()


def _key(mesh: Mesh) -> tuple[int, ...]:
    return tuple(d.id for d in mesh.devices.flat)


class _Program:
    """One collective's jitted program, and on JAX's CPU platform its variant that writes the result into
    a donated spare buffer (see `_run`)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.plain = jax.jit(fn)
        self.recycling = jax.jit(lambda b, z, _spare: fn(b, z), donate_argnums=(2,), keep_unused=True)
        self.spare_key: tuple | None = None  # the result's pool key once known, when large enough to want one


def _run(name: str, mesh: Mesh, x: jax.Array, body: Callable[[jax.Array], jax.Array], replicated: bool,
         *static: Any) -> jax.Array:
    """body(local block) -> local result, run as one program over `mesh`; `replicated`: the result is
    the same on every rank (out spec P()), else each rank's own block.

    The program is dispatched on the collective stream and returns before its peers arrive (see
    `_BALLAST`), as an NCCL collective returns to the host once it is enqueued.

    On JAX's CPU platform a large result is written into a spare buffer of its shape when the pool has
    one (device/storage.py: the buffer an in-place collective's tensor held before, or a freed one):
    every fresh result buffer there is new memory that the kernel page-faults in, 4 KiB at a time (16,385
    faults per 64 MiB all_reduce), and XLA's all-reduce otherwise writes a temporary it then copies
    into a donated input. With the spare donated as an input nothing reads, XLA writes the result into it."""
    k = (name, _key(mesh), x.shape, x.dtype, static)
    prog = _programs.get(k)
    if prog is None:
        prog = _programs[k] = _Program(
            jax.shard_map(lambda b, z: (body(b), jnp.sum(z * z)[None]), mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                          out_specs=(P() if replicated else P(AXIS), P(AXIS)), check_vma=False))
    size = mesh.devices.size
    sharding = NamedSharding(mesh, P(AXIS))
    device = x.devices().pop()
    glob = jax.make_array_from_single_device_arrays((size * x.shape[0], *x.shape[1:]), sharding, [x])
    ballast = _ballast(mesh, sharding, x)
    spare = None
    taken = storage.SPARES.take([prog.spare_key]) if prog.spare_key is not None else None
    if taken:
        local = taken.pop()
        out_sharding = NamedSharding(mesh, P()) if replicated else sharding
        shape = local.shape if replicated else (size * local.shape[0], *local.shape[1:])
        spare = jax.make_array_from_single_device_arrays(shape, out_sharding, [local])
        del local
        COUNTERS["spare_results"] += 1

    def call() -> jax.Array:
        if spare is not None:
            return prog.recycling(glob, ballast, spare)[0].addressable_data(0)
        return prog.plain(glob, ballast)[0].addressable_data(0)

    out = run_collective(device.id, call)
    if prog.spare_key is None and out.nbytes >= storage.SPARE_MIN_BYTES and storage.spares_enabled(device):
        prog.spare_key = storage.SparePool.key(out.shape, out.dtype, device)
        storage.SPARES.want([prog.spare_key])
    return out


# XLA:CPU runs a program it estimates at under 1000 flops inline on the dispatching thread, and a
# collective counts no flops: the caller then blocked until every peer had arrived (a 300 ms late peer
# held the host 300 ms, and with it the dispatch of all the compute that could have run meanwhile).
# Each collective program therefore also sums the squares of a small constant block (2,048 flops), which
# makes XLA dispatch it asynchronously; it runs on the collective execution stream (device/runtime.py), in
# dispatch order with the other collectives, and waits for compute only through the buffers it reads.
_BALLAST = 1024
_ballasts: dict[Any, jax.Array] = {}


def _ballast(mesh: Mesh, sharding: NamedSharding, like: jax.Array) -> jax.Array:
    k = _key(mesh)
    z = _ballasts.get(k)
    if z is None:
        local = jax.device_put(jnp.zeros((_BALLAST,), jnp.float32), like.devices().pop())
        z = _ballasts[k] = jax.make_array_from_single_device_arrays((mesh.devices.size * _BALLAST,), sharding,
                                                                     [local])
    return z


def _reduce_stacked(stacked: jax.Array, op: str) -> jax.Array:
    """Reduce a (group size, n) stack of every rank's block over ranks."""
    if op == "product":
        return jnp.prod(stacked, axis=0, dtype=stacked.dtype)
    if op in ("band", "bor", "bxor"):
        fn = {"band": jnp.bitwise_and, "bor": jnp.bitwise_or, "bxor": jnp.bitwise_xor}[op]
        out = stacked[0]
        for i in range(1, stacked.shape[0]):
            out = fn(out, stacked[i])
        return out
    if op in ("sum", "max") and stacked.dtype == jnp.bool_:
        return jnp.any(stacked, axis=0)
    if op == "min" and stacked.dtype == jnp.bool_:
        return jnp.all(stacked, axis=0)
    return {"sum": jnp.sum, "max": jnp.max, "min": jnp.min}[op](stacked, axis=0).astype(stacked.dtype)


def _check_op(op: str, dtype: Any) -> None:
    if op not in REDUCE_OPS:
        raise ValueError(f"torchbridge: unsupported reduce op {op!r}")
    if op in ("band", "bor", "bxor") and not (jnp.issubdtype(dtype, jnp.integer) or dtype == jnp.bool_):
        raise TypeError(f"torchbridge: ReduceOp.{op.upper()} needs an integer or bool tensor, not {dtype}")
    if op in ("avg", "premul_sum") and not jnp.issubdtype(dtype, jnp.inexact):
        raise TypeError(f"torchbridge: ReduceOp.{op.upper()} needs a floating-point tensor, not {dtype}")


# ---- bodies: traced inside a shard_map over `axis` (of `size` ranks); the compile backend's lowerings
# of PyTorch's functional collectives call these too, inside a whole graph's program ----------------
def reduce_body(x: jax.Array, op: str, factor: float | None, axis: Any, size: int) -> jax.Array:
    """The reduction of every rank's `x` over the group."""
    _check_op(op, x.dtype)
    if op == "premul_sum":
        x = x * jnp.asarray(factor, x.dtype)
    if x.dtype != jnp.bool_ and op in ("sum", "avg", "premul_sum"):
        out = lax.psum(x, axis)
        return out / jnp.asarray(size, x.dtype) if op == "avg" else out
    if x.dtype != jnp.bool_ and op in ("max", "min"):
        return (lax.pmax if op == "max" else lax.pmin)(x, axis)
    return _reduce_stacked(lax.all_gather(x, axis), op)


def reduce_scatter_body(x: jax.Array, op: str, factor: float | None, axis: Any, size: int) -> jax.Array:
    """x: (size * m, ...) per rank; the reduction over ranks of block number `rank` (m, ...).

    Sums are XLA's reduce-scatter, except on JAX's CPU platform: there XLA's gloo reduce-scatter copies
    the whole input into a fresh temporary and runs gloo's halving-doubling over it, 1.9-2.5x the time of
    an all-to-all of the blocks and a local sum (2 ranks, 4-64 MiB, measured: 8.9 vs 2.7 ms at 4 MiB, 175
    vs 78 ms at 64 MiB), which moves the same bytes. On TPU the reduce-scatter is the native one."""
    _check_op(op, x.dtype)
    if op == "premul_sum":
        x = x * jnp.asarray(factor, x.dtype)
    summing = x.dtype != jnp.bool_ and op in ("sum", "avg", "premul_sum")
    if summing and STATE.platform != "cpu":
        out = lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True)
    else:
        # every rank's block for me, stacked, then reduced here
        mine = lax.all_to_all(x.reshape(size, -1), axis, split_axis=0, concat_axis=0, tiled=False)
        out = _reduce_stacked(mine.reshape(size, -1), "sum" if summing else op)
        out = out.reshape((x.shape[0] // size, *x.shape[1:]))
    return out / jnp.asarray(size, x.dtype) if op == "avg" else out


def broadcast_body(x: jax.Array, root: int, axis: Any) -> jax.Array:
    """Every rank gets `root`'s x: a sum of the root's bits and zeros from everyone else."""
    dtype = x.dtype
    if jnp.issubdtype(dtype, jnp.complexfloating):
        pair = lax.bitcast_convert_type(x, jnp.float32 if dtype == jnp.complex64 else jnp.float64)
        return lax.bitcast_convert_type(broadcast_body(pair, root, axis), dtype)
    bits = _as_bits(x)
    mine = lax.axis_index(axis) == root
    return _from_bits(lax.psum(jnp.where(mine, bits, jnp.zeros_like(bits)), axis), dtype)


def all_to_all_body(x: jax.Array, axis: Any, size: int) -> jax.Array:
    """(size * m, ...) per rank: block j goes to rank j; returns block i from rank i, in rank order."""
    out = lax.all_to_all(x.reshape(size, -1), axis, 0, 0, tiled=False)
    return out.reshape(x.shape)


# ---- eager: one program per collective over a group's 1-d mesh --------------------------------------
def all_reduce(mesh: Mesh, x: jax.Array, op: str, factor: float | None = None) -> jax.Array:
    _check_op(op, x.dtype)
    size = mesh.devices.size
    return _run("all_reduce", mesh, x, lambda b: reduce_body(b, op, factor, AXIS, size), True, op, factor)


def reduce_scatter(mesh: Mesh, x: jax.Array, op: str, factor: float | None = None) -> jax.Array:
    """x: this rank's (size * m,) input; returns the reduction of every rank's m-block number `rank`."""
    _check_op(op, x.dtype)
    size = mesh.devices.size
    return _run("reduce_scatter", mesh, x, lambda b: reduce_scatter_body(b, op, factor, AXIS, size), False, op,
                factor)


def _as_bits(x: jax.Array) -> jax.Array:
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint8)
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}")) if x.dtype.itemsize <= 8 else x


def _from_bits(x: jax.Array, dtype: Any) -> jax.Array:
    if dtype == jnp.bool_:
        return x.astype(jnp.bool_)
    return lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def broadcast(mesh: Mesh, x: jax.Array, root: int) -> jax.Array:
    return _run("broadcast", mesh, x, lambda b: broadcast_body(b, root, AXIS), True, root)


def all_gather(mesh: Mesh, x: jax.Array) -> jax.Array:
    """(n,) per rank -> (size * n,): every rank's block in rank order."""
    return _run("all_gather", mesh, x, lambda b: lax.all_gather(b, AXIS, axis=0, tiled=True), True)


def all_to_all(mesh: Mesh, x: jax.Array) -> jax.Array:
    """(size * m,) per rank: block j goes to rank j; returns (size * m,): block i came from rank i."""
    size = mesh.devices.size
    return _run("all_to_all", mesh, x, lambda b: all_to_all_body(b, AXIS, size), False)


def permute(mesh: Mesh, x: jax.Array, pairs: tuple[tuple[int, int], ...]) -> jax.Array:
    """Mesh position s sends its x to position d for each (s, d); positions that receive nothing get zeros."""
    return _run("permute", mesh, x, lambda b: lax.ppermute(b, AXIS, pairs), False, pairs)


def cache_size() -> int:
    return len(_programs)
