"""The lowering table: ATen op -> JAX function. Eager and compile both run these same functions.

A lowering takes the op's arguments with tensors replaced by JAX arrays (Python scalars stay scalars,
possibly traced) and returns JAX arrays. It only has to get the *values* right: output shapes and
dtypes are fixed by PyTorch's own meta kernels and the caller casts to them, so type promotion and
broadcasting rules are exactly PyTorch's. Lowerings are registered by op packet name ("add"), so one
function serves add.Tensor, add.Scalar, the in-place add_ and the out= variant.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
from jax.extend.random import threefry2x32_p


@dataclass(frozen=True)
class Lowering:
    fn: Callable[..., Any]
    random: bool = False  # needs ctx.key(): a fresh PRNG key per call
    mutates: tuple[str, ...] = ()  # extra mutable args; fn returns (result, {name: new_value})
    static: tuple[str, ...] = ()  # Scalar args whose value changes the program (not traced)
    dynamic: tuple[str, ...] = ()  # `float` args traced as values (e.g. a scheduled learning rate)


LOWERINGS: dict[str, Lowering] = {}

# Ops whose CompositeExplicitAutograd kernel would win over the device fallback (PyTorch prefers it to a
# backend fallback): convolution_overrideable only throws, native_layer_norm detours through batch
# norm. Lowering modules name such overloads here; registration.register gives each one an explicit
# device kernel that enters the fallback.
KERNEL_OVERRIDES: set[str] = set()


def lower(*ops: Any, random: bool = False, mutates: tuple[str, ...] = (), static: tuple[str, ...] = (),
          dynamic: tuple[str, ...] = ()):
    """Register `fn` as the lowering of each op (an OpOverloadPacket, OpOverload, or name)."""

    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        for op in ops:
            key = op_key(op)
            if key in LOWERINGS:  # two modules lowering one op would silently shadow each other
                raise RuntimeError(f"torchbridge: lowering for '{key}' registered twice")
            LOWERINGS[key] = Lowering(fn, random=random, mutates=mutates, static=static, dynamic=dynamic)
        return fn

    return deco


def op_key(op: Any) -> str:
    if isinstance(op, str):
        return op
    if isinstance(op, torch_ops.OpOverload):
        name = op._schema.name.split("::")[-1]
        return f"{name}.{op._overloadname}" if op._overloadname != "default" else name
    return op._qualified_op_name.split("::")[-1]


def functional_name(op: Any) -> str:
    """'add_' -> 'add'; '__iand__' -> '__and__'; other names unchanged."""
    name = op._schema.name.split("::")[-1]
    if name.startswith("__i") and name.endswith("__"):
        return "__" + name[3:]
    if name.endswith("_") and not name.endswith("__"):
        return name[:-1]
    return name


def find(op: Any) -> Lowering | None:
    base = functional_name(op)
    overload = op._overloadname
    ns = op.namespace
    if ns != "aten":  # prims/other namespaces may differ in signature from the aten op of that name
        found = LOWERINGS.get(f"{ns}::{base}")
        if found is not None:
            return found
    return LOWERINGS.get(f"{base}.{overload}") or LOWERINGS.get(base)


@dataclass
class TraceContext:
    """What a lowering may ask about the call being traced."""

    out_shapes: list[tuple[int, ...]] = field(default_factory=list)
    out_dtypes: list[jnp.dtype] = field(default_factory=list)
    rng: Any = None  # (seed, offset), uint64 each: where a random op draws (device/runtime.py)
    # in a graph that runs on several ranks' chips (compile/spmd.py): process group name -> mesh axis
    # ("_sizes": group name -> size), for the lowerings of collectives
    axes: dict[str, Any] = field(default_factory=dict)
    _draws: int = 0

    def _seed_offset(self) -> tuple[Any, Any]:
        if self.rng is None:
            raise RuntimeError("torchbridge: this lowering was not registered with random=True")
        return jnp.asarray(self.rng[0], jnp.uint64), jnp.asarray(self.rng[1], jnp.uint64)

    def bits(self, shape: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
        """Two uint32 words per element, counter-based: element i (row-major) is the Threefry hash of
        (seed, offset + i), so a shard drawn at its own offset equals that part of the whole. A second
        draw in the same op hashes a key derived from the first (still reproducible)."""
        seed, offset = self._seed_offset()
        n = math.prod(shape)
        counter = offset + jnp.arange(n, dtype=jnp.uint64)
        hi, lo = (counter >> 32).astype(jnp.uint32), counter.astype(jnp.uint32)
        if self._draws:
            k = jax.random.key_data(self.key())
            k1, k2 = k[0], k[1]
        else:
            k1, k2 = (seed >> 32).astype(jnp.uint32), seed.astype(jnp.uint32)
        self._draws += 1
        w0, w1 = threefry2x32_p.bind(k1, k2, hi, lo)
        return w0.reshape(shape), w1.reshape(shape)

    def key(self) -> jax.Array:
        """A JAX PRNG key for draws that are not element by element (permutations, categorical)."""
        seed, offset = self._seed_offset()
        self._draws += 1
        base = jax.random.fold_in(jax.random.key(seed), (offset >> 32).astype(jnp.uint32))
        return jax.random.fold_in(jax.random.fold_in(base, offset.astype(jnp.uint32)), self._draws)


_ctx: list[TraceContext] = []


def ctx() -> TraceContext:
    return _ctx[-1]


@contextlib.contextmanager
def tracing(c: TraceContext) -> Iterator[TraceContext]:
    _ctx.append(c)
    try:
        yield c
    finally:
        _ctx.pop()


import torch._ops as torch_ops  # noqa: E402  (kept last: only for isinstance checks)
