"""Least squares: linalg_lstsq, min_x ||A x - B||_F for every matrix of a batch.

The solution is the minimum-norm one, x = V diag(1/s) U^H B over the singular values above
rcond * s_max (rcond defaults to eps * max(m, n), as in PyTorch): for a full-rank A this is what every
LAPACK driver returns (gels by QR/LQ, gelsy by a complete orthogonal factorization, gelsd/gelss by
the SVD). Which of the by-products exist depends on the driver; the meta kernel has already sized
them, so an empty output shape means "not computed":
residuals (sum of squared residuals per column, when m > n), rank (gelsy/gelsd/gelss) and
singular_values (gelsd/gelss).

linalg_lstsq reaches the device as linalg_lstsq.out, which has no Meta kernel; the one below sizes the
outputs by PyTorch's rules. One difference remains: for a rank-deficient A with m > n, the CPU
drops the residuals (gelsd/gelss) after seeing the rank, which a shape fixed before the data cannot
do, so they are returned (as ||A x - B||^2 of the minimum-norm solution).
"""

from __future__ import annotations

import jax.numpy as jnp

from torchbridge.device.lowerings.registry import ctx, lower


def _mH(x):
    return jnp.conj(jnp.swapaxes(x, -1, -2))


@lower("linalg_lstsq")
def linalg_lstsq(a, b, rcond=None, *, driver=None):
    c = ctx()
    x_dt, res_dt, rank_dt, sv_dt = c.out_dtypes
    x_shape, res_shape, rank_shape, sv_shape = c.out_shapes
    a, b = a.astype(x_dt), b.astype(x_dt)
    m, n = a.shape[-2], a.shape[-1]
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])
    if vector:
        b = b[..., None]
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = jnp.broadcast_to(a, batch + a.shape[-2:])
    b = jnp.broadcast_to(b, batch + b.shape[-2:])
    real = jnp.real(jnp.zeros((), x_dt)).dtype
    if min(m, n) == 0 or b.shape[-1] == 0:
        x = jnp.zeros(batch + (n, b.shape[-1]), x_dt)
        s = jnp.zeros(batch + (min(m, n),), real)
    else:
        u, s, vh = jnp.linalg.svd(a, full_matrices=False)
        tol = (jnp.finfo(real).eps * max(m, n)) if rcond is None or rcond <= 0 else rcond
        keep = s > tol * s[..., :1]
        inv_s = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(x_dt)
        x = _mH(vh) @ (inv_s[..., :, None] * (_mH(u) @ b))
    rank = jnp.sum(s > ((jnp.finfo(real).eps * max(m, n)) if rcond is None or rcond <= 0 else rcond)
                   * (s[..., :1] if s.shape[-1] else 0), axis=-1)
    if vector:
        x = x[..., 0]
    out_x = x.reshape(x_shape)
    if res_shape and all(res_shape):
        r = a @ (x[..., None] if vector else x) - b
        res = jnp.sum(jnp.abs(r) ** 2, axis=-2).astype(res_dt)
        res = res.reshape(res_shape)
    else:
        res = jnp.zeros(res_shape, res_dt)
    out_rank = rank.astype(rank_dt).reshape(rank_shape) if _numel(rank_shape) == rank.size else jnp.zeros(rank_shape, rank_dt)
    out_sv = s.astype(sv_dt).reshape(sv_shape) if _numel(sv_shape) == s.size else jnp.zeros(sv_shape, sv_dt)
    return out_x, res, out_rank, out_sv


def _numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out
