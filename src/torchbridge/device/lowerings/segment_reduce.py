"""segment_reduce: reduce consecutive segments along `axis` (sum, mean, max, min, prod) and its
backward.

Segments are given by `lengths` (..., S) or `offsets` (..., S + 1), whose leading dimensions match
the data's dimensions before `axis`; each element gets a segment id and the reductions are
jax.ops.segment_* over it (an element past the last segment gets id S and is dropped). As on the CPU:
`initial` (or the reduction's identity) starts every segment, so an empty segment holds it; mean is
(initial + sum) / length, and an empty segment's mean is `initial`, or nan without one; a nan makes
its segment's max/min nan.

Backward, as on the CPU: mean divides by the length; max/min send the gradient to the elements equal
to the result (nan ones too), shared evenly among ties; prod uses output / x, except for zeros and
nans, which get the product of the rest of their segment. (PyTorch's CPU kernel splits a tie's
gradient only where it is positive, so a negative gradient reaches every tied element in full there;
this lowering splits it evenly in every case.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torchbridge.device.lowerings.registry import ctx, lower


def _lengths(lengths, offsets):
    if lengths is not None:
        return lengths
    return offsets[..., 1:] - offsets[..., :-1]


def _flat(data, lens, axis: int):
    """data as (O, N, inner...) and lengths as (O, S), O = prod(data.shape[:axis])."""
    outer = data.shape[:axis]
    o = 1
    for d in outer:
        o *= d
    return data.reshape((o,) + data.shape[axis:]), lens.reshape((o, lens.shape[-1]))


def _ids(lens, n: int):
    """Segment id of each of n positions; S for positions past the last segment."""
    ends = jnp.cumsum(lens)
    return jnp.searchsorted(ends, jnp.arange(n), side="right")


def _expand(v, like):
    """(S,) -> (S, 1, ...) to broadcast against (S, inner...)."""
    return v.reshape(v.shape + (1,) * (like.ndim - 1))


def _identity(reduce: str, dt):
    if reduce == "max":
        return jnp.asarray(-jnp.inf, dt)
    if reduce == "min":
        return jnp.asarray(jnp.inf, dt)
    if reduce == "prod":
        return jnp.asarray(1, dt)
    return jnp.asarray(0, dt)


def _reduce_one(x, lens, reduce: str, initial):
    s = lens.shape[0]
    ids = _ids(lens, x.shape[0])
    start = _identity(reduce, x.dtype) if initial is None else jnp.asarray(initial).astype(x.dtype)
    if reduce in ("sum", "mean"):
        acc = jax.ops.segment_sum(x, ids, num_segments=s) + start
        if reduce == "sum":
            return acc
        n = _expand(lens, acc).astype(x.dtype)
        empty = jnp.asarray(jnp.nan, x.dtype) if initial is None else start
        return jnp.where(n > 0, acc / jnp.where(n > 0, n, 1), empty)
    if reduce == "prod":
        return jax.ops.segment_prod(x, ids, num_segments=s) * start
    fn = jax.ops.segment_max if reduce == "max" else jax.ops.segment_min
    pick = jnp.maximum if reduce == "max" else jnp.minimum
    has_nan = jax.ops.segment_max(jnp.isnan(x).astype(jnp.int32), ids, num_segments=s) > 0
    ext = fn(jnp.where(jnp.isnan(x), start, x), ids, num_segments=s)
    ext = jnp.where(_expand(lens, ext) > 0, pick(ext, start), start)
    return jnp.where(has_nan, jnp.asarray(jnp.nan, x.dtype), ext)


@lower("segment_reduce")
def segment_reduce(data, reduce, *, lengths=None, indices=None, offsets=None, axis=0, unsafe=False, initial=None):
    dt = ctx().out_dtypes[0]
    axis = axis % data.ndim
    lens = _lengths(lengths, offsets)
    x, lens2 = _flat(data.astype(dt), lens, axis)
    out = jax.vmap(lambda xi, li: _reduce_one(xi, li, reduce, initial))(x, lens2)
    return out.reshape(ctx().out_shapes[0])


def _backward_one(g, out, x, lens, reduce: str, initial):
    s = lens.shape[0]
    ids = _ids(lens, x.shape[0])
    valid = _expand(ids < s, x)
    safe_ids = jnp.minimum(ids, s - 1) if s else ids
    g_e, out_e = g[safe_ids], out[safe_ids]  # each element's segment gradient and result
    zero = jnp.zeros_like(x)
    if reduce == "sum":
        res = g_e
    elif reduce == "mean":
        n = _expand(lens, g).astype(x.dtype)[safe_ids]
        res = g_e / jnp.where(n > 0, n, 1)
    elif reduce in ("max", "min"):
        hit = jnp.isnan(x) | (x == out_e)
        ties = jax.ops.segment_sum(hit.astype(x.dtype), ids, num_segments=s)[safe_ids]
        res = jnp.where(hit, g_e / jnp.where(ties > 0, ties, 1), zero)
    else:  # prod
        start = jnp.asarray(1 if initial is None else initial).astype(x.dtype)
        is_zero, is_nan = x == 0, jnp.isnan(x)
        plain = ~(is_zero | is_nan)
        rest = jax.ops.segment_prod(jnp.where(plain, x, 1), ids, num_segments=s)[safe_ids] * start
        zeros = jax.ops.segment_sum(is_zero.astype(jnp.int32), ids, num_segments=s)[safe_ids]
        nans = jax.ops.segment_sum(is_nan.astype(jnp.int32), ids, num_segments=s)[safe_ids]
        # the product of the other elements of the segment, for a zero or nan element
        others_zero = zeros - is_zero.astype(jnp.int32)
        others_nan = nans - is_nan.astype(jnp.int32)
        excl = jnp.where(others_nan > 0, jnp.nan, jnp.where(others_zero > 0, 0, rest)).astype(x.dtype)
        res = jnp.where(plain, g_e * out_e / jnp.where(plain, x, 1), g_e * excl)
    return jnp.where(valid, res, zero)


@lower("_segment_reduce_backward")
def segment_reduce_backward(grad, output, data, reduce, *, lengths=None, offsets=None, axis=0, initial=None):
    dt = ctx().out_dtypes[0]
    axis = axis % data.ndim
    lens = _lengths(lengths, offsets)
    x, lens2 = _flat(data.astype(dt), lens, axis)
    g, _ = _flat(grad.astype(dt), lens, axis)
    o, _ = _flat(output.astype(dt), lens, axis)
    res = jax.vmap(lambda gi, oi, xi, li: _backward_one(gi, oi, xi, li, reduce, initial))(g, o, x, lens2)
    return res.reshape(data.shape)
