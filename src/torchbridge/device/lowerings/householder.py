"""Householder QR in LAPACK's compact form: geqrf, linalg_householder_product (orgqr) and ormqr.

geqrf returns R in the upper triangle and the Householder vectors v_i below the diagonal (v_i[i] = 1
implied) with their scalars tau_i, Q = H_1 ... H_k, H_i = I - tau_i v_i v_i^H. JAX exposes no public
geqrf, so it is computed here column by column with LAPACK's reflector convention (the one PyTorch's
CPU kernel returns): for x = A[i:, i], beta = -sign(Re x_0) |x|, tau = (beta - x_0) / beta,
v = x / (x_0 - beta) with v_0 = 1, and tau = 0 (H = I) when x has nothing below x_0 to annihilate.
XLA's CPU backend runs LAPACK's orgqr for lax.linalg.householder_product.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from torchbridge.device.lowerings.registry import ctx, lower


def _geqrf_one(a):
    """Unblocked Householder QR of one (m, n) matrix in LAPACK's compact form."""
    m, n = a.shape
    k = min(m, n)
    rows = jnp.arange(m)
    cols = jnp.arange(n)
    real = a.real.dtype

    def step(i, state):
        a, tau = state
        x = a[:, i]
        alpha = x[i]
        below = rows > i
        xnorm = jnp.sqrt(jnp.sum(jnp.where(below, jnp.abs(x) ** 2, 0).astype(real)))
        identity = (xnorm == 0) & (jnp.imag(alpha) == 0)
        norm = jnp.sqrt(jnp.abs(alpha) ** 2 + xnorm**2)
        beta = jnp.where(jnp.real(alpha) >= 0, -norm, norm)
        safe_beta = jnp.where(identity, 1, beta)
        t = jnp.where(identity, 0, (beta - alpha) / safe_beta).astype(a.dtype)
        scale = jnp.where(identity, 1, alpha - beta).astype(a.dtype)
        v = jnp.where(below, x / scale, jnp.where(rows == i, 1, 0)).astype(a.dtype)
        # H^H = I - conj(tau) v v^H applied to the trailing columns
        w = jnp.conj(v) @ a
        upd = a - jnp.conj(t) * jnp.outer(v, w)
        a = jnp.where(cols[None, :] > i, upd, a)
        newcol = jnp.where(below, v, jnp.where(rows == i, jnp.where(identity, alpha, beta).astype(a.dtype), x))
        a = a.at[:, i].set(newcol)
        return a, tau.at[i].set(t)

    return lax.fori_loop(0, k, step, (a, jnp.zeros((k,), a.dtype)))


@lower("geqrf")
def geqrf(a):
    dt = ctx().out_dtypes[0]
    if a.size == 0:
        return jnp.zeros(ctx().out_shapes[0], dt), jnp.zeros(ctx().out_shapes[1], dt)
    a = a.astype(dt)
    batch = a.shape[:-2]
    flat = a.reshape((-1,) + a.shape[-2:])
    r, tau = jax.vmap(_geqrf_one)(flat)
    return r.reshape(a.shape), tau.reshape(batch + tau.shape[-1:])


def _householder(a, tau):
    """Q's first a.shape[-1] columns (orgqr); tau may be shorter than a's columns."""
    n, k = a.shape[-1], tau.shape[-1]
    if k < n:  # missing reflectors are identities (tau = 0)
        tau = jnp.concatenate([tau, jnp.zeros(tau.shape[:-1] + (n - k,), tau.dtype)], axis=-1)
    batch = jnp.broadcast_shapes(a.shape[:-2], tau.shape[:-1])
    a = jnp.broadcast_to(a, batch + a.shape[-2:])
    tau = jnp.broadcast_to(tau, batch + tau.shape[-1:])
    if a.size == 0:
        return jnp.zeros(a.shape, a.dtype)
    return lax.linalg.householder_product(a, tau)


@lower("linalg_householder_product")
def householder_product(a, tau):
    dt = ctx().out_dtypes[0]
    return _householder(a.astype(dt), tau.astype(dt))


@lower("ormqr")
def ormqr(a, tau, other, left=True, transpose=False):
    dt = ctx().out_dtypes[0]
    a, tau, other = a.astype(dt), tau.astype(dt), other.astype(dt)
    m, k = a.shape[-2], a.shape[-1]
    if k < m:  # the full m x m Q: pad with zero reflector columns
        a = jnp.concatenate([a, jnp.zeros(a.shape[:-1] + (m - k,), a.dtype)], axis=-1)
    else:
        a = a[..., :, :m]
    q = _householder(a, tau[..., :m])
    if transpose:
        q = jnp.conj(jnp.swapaxes(q, -1, -2))
    return jnp.matmul(q, other) if left else jnp.matmul(other, q)
