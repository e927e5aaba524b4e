"""Reading and writing strided views of a flat storage buffer, inside traced JAX code.

A device storage is one flat, immutable JAX array. A tensor is (shape, strides, offset, dtype) over
it, exactly as on CPU. Reads gather the view's elements; writes return a new flat buffer with the
view's elements replaced. Dense layouts (contiguous, permuted, broadcast) use slices, reshapes and
transposes; anything else falls back to a gather/scatter with computed indices.
"""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np
from jax import lax


class ViewSpec(NamedTuple):
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int


def is_contiguous(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    expected = 1
    for size, stride in zip(reversed(shape), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for size in reversed(shape):
        strides.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(strides))


def _dense_permutation(shape: tuple[int, ...], strides: tuple[int, ...]) -> tuple[int, ...] | None:
    """The dim order that makes a (non-broadcast) view contiguous, or None if it is not dense."""
    order = sorted(range(len(shape)), key=lambda d: (-strides[d], d))
    permuted_shape = tuple(shape[d] for d in order)
    permuted_strides = tuple(strides[d] for d in order)
    return tuple(order) if is_contiguous(permuted_shape, permuted_strides) else None


def swapped_last_two(spec: ViewSpec) -> ViewSpec | None:
    """For a view whose last two axes are a transposed contiguous block (W.t(), k.transpose(-2, -1)),
    the un-transposed view it was made from; None otherwise."""
    shape, strides = spec.shape, spec.strides
    if len(shape) < 2 or is_contiguous(shape, strides):
        return None
    base = ViewSpec((*shape[:-2], shape[-1], shape[-2]), (*strides[:-2], strides[-1], strides[-2]), spec.offset)
    return base if is_contiguous(base.shape, base.strides) else None


def _indices(spec: ViewSpec) -> jnp.ndarray:
    idx = jnp.full(spec.shape, spec.offset, dtype=jnp.int64)
    for d, (size, stride) in enumerate(zip(spec.shape, spec.strides, strict=True)):
        if size > 1 and stride != 0:
            idx = idx + lax.broadcasted_iota(jnp.int64, spec.shape, d) * stride
    return idx


def _split_broadcast(spec: ViewSpec) -> tuple[ViewSpec, tuple[int, ...]]:
    """Drop stride-0 dims (and size-1 dims); return the reduced spec and the kept dim positions."""
    kept = tuple(d for d, (n, s) in enumerate(zip(spec.shape, spec.strides, strict=True)) if n != 1 and s != 0)
    return ViewSpec(tuple(spec.shape[d] for d in kept), tuple(spec.strides[d] for d in kept), spec.offset), kept


def read(buf: jnp.ndarray, spec: ViewSpec) -> jnp.ndarray:
    shape = spec.shape
    numel = math.prod(shape)
    if numel == 0:
        return jnp.zeros(shape, buf.dtype)
    if is_contiguous(shape, spec.strides):
        if spec.offset == 0 and numel == buf.shape[0]:
            return buf.reshape(shape)
        return lax.slice(buf, (spec.offset,), (spec.offset + numel,)).reshape(shape)
    reduced, kept = _split_broadcast(spec)
    if len(kept) < len(shape):
        inner = read(buf, reduced)
        expanded = inner.reshape(tuple(n if d in kept else 1 for d, n in enumerate(shape)))
        return jnp.broadcast_to(expanded, shape)
    perm = _dense_permutation(shape, spec.strides)
    if perm is not None:
        permuted = read(buf, ViewSpec(tuple(shape[d] for d in perm), contiguous_strides(tuple(shape[d] for d in perm)), spec.offset))
        return jnp.transpose(permuted, np.argsort(perm))
    return buf[_indices(spec)]


def write(buf: jnp.ndarray, spec: ViewSpec, values: jnp.ndarray) -> jnp.ndarray:
    """`buf` with the view's elements set to `values` (broadcast to the view's shape)."""
    shape = spec.shape
    numel = math.prod(shape)
    if numel == 0:
        return buf
    values = jnp.broadcast_to(values.astype(buf.dtype), shape)
    if is_contiguous(shape, spec.strides):
        flat = values.reshape(-1)
        if spec.offset == 0 and numel == buf.shape[0]:
            return flat
        return lax.dynamic_update_slice(buf, flat, (spec.offset,))
    perm = _dense_permutation(shape, spec.strides)
    if perm is not None and 0 not in spec.strides:
        permuted = jnp.transpose(values, perm)
        dense = ViewSpec(permuted.shape, contiguous_strides(permuted.shape), spec.offset)
        return write(buf, dense, permuted)
    return buf.at[_indices(spec).reshape(-1)].set(values.reshape(-1))


def storage_numel(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    """Elements a fresh storage needs to hold a (shape, strides) view at offset 0."""
    if math.prod(shape) == 0:
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, strides, strict=True))


def cast(x: jnp.ndarray, dtype: jnp.dtype) -> jnp.ndarray:
    """`x` as `dtype`, with PyTorch's meaning for bool: nonzero is True."""
    x = jnp.asarray(x)
    if dtype == jnp.bool_ and x.dtype != jnp.bool_:
        return x != 0
    return x.astype(dtype)


def layout(values: jnp.ndarray, spec: ViewSpec, storage_numel: int) -> jnp.ndarray:
    """A fresh flat storage holding `values` at the positions `spec` describes."""
    if spec.offset == 0 and is_contiguous(spec.shape, spec.strides) and math.prod(spec.shape) == storage_numel:
        return values.reshape(-1)
    return write(jnp.zeros((storage_numel,), values.dtype), spec, values)


@functools.lru_cache(maxsize=256)  # asked per written buffer of every compiled call; dtypes are few
def same_width(a: Any, b: Any) -> bool:
    """Whether elements of dtype `a` reinterpret as elements of `b` one for one: one bitcast (the same
    item size, neither bool nor complex), or none (the same dtype)."""
    a, b = jnp.dtype(a), jnp.dtype(b)
    plain = not any(x == jnp.bool_ or jnp.issubdtype(x, jnp.complexfloating) for x in (a, b))
    return a == b or (plain and a.itemsize == b.itemsize)


def bitcast_flat(buf: jnp.ndarray, dtype: jnp.dtype, count: int) -> jnp.ndarray:
    """Reinterpret a flat buffer's bytes as `count` elements of `dtype` (bool as 0/1 bytes)."""
    if buf.dtype == dtype and buf.shape[0] == count:
        return buf
    dtype = jnp.dtype(dtype)
    if buf.shape[0] == count and same_width(buf.dtype, dtype):
        # one bitcast, which XLA cancels against the program's own (16-bit floats moved as bits, lowerings/moves.py)
        return lax.bitcast_convert_type(buf, dtype)
    # XLA cannot bitcast complex values; a complex element is its (real, imag) pair of floats in
    # memory, as in PyTorch's storage (view_as_real, view(dtype) and shared storages rely on it).
    if jnp.issubdtype(dtype, jnp.complexfloating):
        pairs = bitcast_flat(buf, _COMPONENT[dtype], 2 * count).reshape(count, 2)
        return lax.complex(pairs[:, 0], pairs[:, 1])
    if jnp.issubdtype(buf.dtype, jnp.complexfloating):
        return bitcast_flat(jnp.stack([jnp.real(buf), jnp.imag(buf)], axis=-1).reshape(-1), dtype, count)
    if buf.dtype == jnp.bool_:
        raw = buf.astype(jnp.uint8)
    elif buf.dtype.itemsize == 1:
        raw = lax.bitcast_convert_type(buf, jnp.uint8)
    else:
        raw = lax.bitcast_convert_type(buf, jnp.uint8).reshape(-1)
    itemsize = jnp.dtype(dtype).itemsize
    nbytes = count * itemsize
    if raw.shape[0] < nbytes:
        raw = jnp.concatenate([raw, jnp.zeros((nbytes - raw.shape[0],), jnp.uint8)])
    raw = raw[:nbytes]
    if dtype == jnp.bool_:
        return raw != 0
    if itemsize == 1:
        return lax.bitcast_convert_type(raw, dtype)
    return lax.bitcast_convert_type(raw.reshape(count, itemsize), dtype)


_COMPONENT = {jnp.dtype(jnp.complex64): jnp.dtype(jnp.float32), jnp.dtype(jnp.complex128): jnp.dtype(jnp.float64)}
