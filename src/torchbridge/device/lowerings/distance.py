"""p-norm distances: cdist (between two sets of row vectors) and pdist (between the rows of one
matrix), forward and backward.

    dist_p(u, v) = (sum_k |u_k - v_k|^p)^(1/p);  p = 0 counts the differing entries, p = inf is the
    largest |u_k - v_k|.

For p = 2 the CPU kernel may use the matrix-product form |u|^2 + |v|^2 - 2 u.v (clamped at 0) for
speed; we take the same form in the same cases so that both round alike. The backward ops take the
forward result and use d dist / d u_k = sign(d_k) |d_k|^(p-1) / dist^(p-1) with d = u - v, with the
CPU kernels' conventions where that is singular (0 where dist is 0, and where d_k is 0 for p < 1;
for p = inf only the entries attaining the maximum carry the gradient).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from torchbridge.device.lowerings.registry import ctx, lower


def _pnorm(diff, p: float, axis: int = -1):
    """The p-norm of `diff` along `axis`."""
    a = jnp.abs(diff)
    if p == 0:
        return jnp.sum((a != 0).astype(diff.dtype), axis=axis)
    if p == 1:
        return jnp.sum(a, axis=axis)
    if p == 2:
        return jnp.sqrt(jnp.sum(a * a, axis=axis))
    if math.isinf(p):
        return jnp.max(a, axis=axis, initial=0)  # |d| >= 0, so 0 only matters for M == 0
    return jnp.sum(a**p, axis=axis) ** (1.0 / p)


def _pair_grad(diff, dist, p: float):
    """d dist / d u for each pair: `diff` = u - v (..., M), `dist` (...) broadcast over M."""
    dist = dist[..., None]
    zero = jnp.zeros_like(diff)
    if p == 0:
        return zero
    if p == 1:
        return jnp.sign(diff)
    if p == 2:
        safe = jnp.where(dist == 0, jnp.ones_like(dist), dist)
        return jnp.where(dist == 0, zero, diff / safe)
    if math.isinf(p):
        return jnp.sign(diff) * (jnp.abs(diff) == dist).astype(diff.dtype)
    safe = jnp.where(dist == 0, jnp.ones_like(dist), dist)
    a = jnp.abs(diff)
    if p < 2:
        singular = (dist == 0) | ((diff == 0) & (p < 1))
        safe_a = jnp.where(a == 0, jnp.ones_like(a), a)
        g = jnp.sign(diff) * jnp.where(a == 0, zero, safe_a ** (p - 1)) / safe ** (p - 1)
        return jnp.where(singular, zero, g)
    return jnp.where(dist == 0, zero, diff * a ** (p - 2) / safe ** (p - 1))


def _sum_to(x, shape: tuple[int, ...]):
    """Sum broadcast leading dimensions of `x` down to `shape`."""
    lead = x.ndim - len(shape)
    if lead:
        x = jnp.sum(x, axis=tuple(range(lead)))
    axes = tuple(i for i, (n, m) in enumerate(zip(x.shape, shape, strict=True)) if m == 1 and n != 1)
    if axes:
        x = jnp.sum(x, axis=axes, keepdims=True)
    return x.reshape(shape)


def _batch(x1, x2):
    batch = jnp.broadcast_shapes(x1.shape[:-2], x2.shape[:-2])
    return (jnp.broadcast_to(x1, batch + x1.shape[-2:]), jnp.broadcast_to(x2, batch + x2.shape[-2:]))


def _uses_mm(p: float, compute_mode, r1: int, r2: int) -> bool:
    mode = 0 if compute_mode is None else compute_mode
    return p == 2 and (mode == 1 or (mode == 0 and (r1 > 25 or r2 > 25)))


@lower("_cdist_forward")
def cdist_forward(x1, x2, p, compute_mode=None):
    dt = ctx().out_dtypes[0]
    x1, x2 = _batch(x1.astype(dt), x2.astype(dt))
    if _uses_mm(p, compute_mode, x1.shape[-2], x2.shape[-2]):
        n1 = jnp.sum(x1 * x1, axis=-1)[..., :, None]
        n2 = jnp.sum(x2 * x2, axis=-1)[..., None, :]
        prod = jnp.matmul(x1, jnp.swapaxes(x2, -1, -2))
        return jnp.sqrt(jnp.maximum(n1 + n2 - 2 * prod, 0))
    diff = x1[..., :, None, :] - x2[..., None, :, :]
    return _pnorm(diff, p)


@lower("_cdist_backward")
def cdist_backward(grad, x1, x2, p, cdist):
    shape = ctx().out_shapes[0]
    x1b, x2b = _batch(x1, x2)
    diff = x1b[..., :, None, :] - x2b[..., None, :, :]  # (B, P, R, M)
    g = _pair_grad(diff, cdist, p) * grad[..., None]
    return _sum_to(jnp.sum(g, axis=-2), shape).astype(ctx().out_dtypes[0])


def _pairs(n: int):
    i, j = np.triu_indices(n, 1)
    return jnp.asarray(i), jnp.asarray(j)


@lower("_pdist_forward")
def pdist_forward(a, p=2.0):
    i, j = _pairs(a.shape[0])
    return _pnorm(a[i] - a[j], p)


@lower("_pdist_backward")
def pdist_backward(grad, a, p, pdist):
    n = a.shape[0]
    i, j = _pairs(n)
    g = _pair_grad(a[i] - a[j], pdist, p) * grad[:, None]  # d/d a_i; d/d a_j is its negation
    out = jnp.zeros_like(a).at[i].add(g).at[j].add(-g)
    return out.astype(ctx().out_dtypes[0])
