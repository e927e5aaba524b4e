"""Dense linear algebra: inverse, solve, Cholesky, LU, determinants, triangular solves, matrix_exp.

The ATen ops behind torch.linalg also return LAPACK's by-products (LU factors, 1-based int32
pivots, an int32 `info` that is 0 on success); autograd formulas read them, so they are returned in
LAPACK's conventions (XLA's LU uses the same partial pivoting as getrf).
"""

from __future__ import annotations

import jax.numpy as jnp
import jax.scipy.linalg as jsl
from jax import lax

from torchbridge.device.lowerings.registry import ctx, lower


def _dt(i: int = 0):
    return ctx().out_dtypes[i]


def _info(a):
    return jnp.zeros(a.shape[:-2], jnp.int32)


def _lu(a):
    lu, piv, _ = lax.linalg.lu(a)
    return lu, (piv + 1).astype(jnp.int32)


def _mT(x):
    return jnp.swapaxes(x, -1, -2)


@lower("linalg_inv_ex")
def inv_ex(a, *, check_errors=False):
    return jnp.linalg.inv(a.astype(_dt())), _info(a)


@lower("_linalg_solve_ex")
def solve_ex(a, b, *, left=True, check_errors=False):
    dt = _dt()
    a, b = a.astype(dt), b.astype(dt)
    vector = ctx().out_shapes[0] == tuple(b.shape) and (b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1]))
    if vector:
        b = b[..., None]
    if left:
        x = jnp.linalg.solve(a, jnp.broadcast_to(b, jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2]) + b.shape[-2:]))
    else:
        x = _mT(jnp.linalg.solve(_mT(a), _mT(b)))
    if vector:
        x = x[..., 0]
    lu, piv = _lu(a)
    return x, lu, piv, _info(a)


@lower("linalg_cholesky_ex")
def cholesky_ex(a, *, upper=False, check_errors=False):
    low = jnp.linalg.cholesky(a.astype(_dt()))
    return (_mT(low) if upper else low), _info(a)


@lower("cholesky")
def cholesky(a, upper=False):
    low = jnp.linalg.cholesky(a.astype(_dt()))
    return _mT(low) if upper else low


@lower("_cholesky_solve_helper")
def cholesky_solve_helper(b, factor, upper):
    return jsl.cho_solve((factor, not upper), b)


@lower("cholesky_inverse")
def cholesky_inverse(factor, upper=False):
    eye = jnp.broadcast_to(jnp.eye(factor.shape[-1], dtype=factor.dtype), factor.shape)
    return jsl.cho_solve((factor, not upper), eye)


@lower("_linalg_det")
def det(a):
    a = a.astype(_dt())
    lu, piv = _lu(a)
    return jnp.linalg.det(a), lu, piv


@lower("_linalg_slogdet")
def slogdet(a):
    a = a.astype(_dt())
    lu, piv = _lu(a)
    sign, logabs = jnp.linalg.slogdet(a)
    return sign, logabs, lu, piv


@lower("linalg_lu_factor_ex")
def lu_factor_ex(a, *, pivot=True, check_errors=False):
    lu, piv = _lu(a)
    return lu, piv, _info(a)


@lower("linalg_lu_solve")
def lu_solve(lu, pivots, b, *, left=True, adjoint=False):
    # Rebuild the permutation from LAPACK's sequential row swaps.
    n = lu.shape[-1]
    perm = lax.linalg.lu_pivots_to_permutation(pivots - 1, n)
    lower_ = jnp.tril(lu, -1) + jnp.eye(n, dtype=lu.dtype)
    upper_ = jnp.triu(lu)
    pmat = jnp.eye(n, dtype=lu.dtype)[perm]  # P @ A = L @ U
    if left and not adjoint:  # A x = b, A = P^T L U
        y = jsl.solve_triangular(lower_, pmat @ b, lower=True, unit_diagonal=True)
        return jsl.solve_triangular(upper_, y, lower=False)
    if left and adjoint:  # A^T x = b: U^T L^T P x = b
        y = jsl.solve_triangular(upper_, b, lower=False, trans=1)
        y = jsl.solve_triangular(lower_, y, lower=True, unit_diagonal=True, trans=1)
        return _mT(pmat) @ y
    # x A = b  <=>  A^T x^T = b^T (and x A^T = b  <=>  A x^T = b^T)
    return _mT(lu_solve(lu, pivots, _mT(b), left=True, adjoint=not adjoint))


@lower("lu_unpack")
def lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    m, n = lu.shape[-2], lu.shape[-1]
    k = min(m, n)
    lower_ = jnp.tril(lu, -1)[..., :, :k] + jnp.eye(m, k, dtype=lu.dtype)
    upper_ = jnp.triu(lu)[..., :k, :]
    perm = lax.linalg.lu_pivots_to_permutation(pivots - 1, m)
    p = _mT(jnp.eye(m, dtype=lu.dtype)[perm])  # A = P L U
    # unpack_pivots=False / unpack_data=False (lu_solve's backward) ask for empty outputs there
    outs, shapes = (p, lower_, upper_), ctx().out_shapes
    if len(shapes) != len(outs):
        return outs
    return tuple(r if 0 not in s else jnp.zeros(s, r.dtype) for r, s in zip(outs, shapes, strict=True))


@lower("linalg_lu")
def linalg_lu(a, *, pivot=True):
    lu, piv = _lu(a.astype(_dt()))
    return lu_unpack(lu, piv)


@lower("linalg_solve_triangular")
def solve_triangular(a, b, *, upper, left=True, unitriangular=False):
    if not left:  # x A = b  <=>  A^T x^T = b^T
        return _mT(solve_triangular(_mT(a), _mT(b), upper=not upper, left=True, unitriangular=unitriangular))
    shape = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = jnp.broadcast_to(a, shape + a.shape[-2:])
    b = jnp.broadcast_to(b, shape + b.shape[-2:])
    return jsl.solve_triangular(a, b, lower=not upper, unit_diagonal=unitriangular)


@lower("triangular_solve")
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    shape = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = jnp.broadcast_to(a, shape + a.shape[-2:])
    b = jnp.broadcast_to(b, shape + b.shape[-2:])
    x = jsl.solve_triangular(a, b, lower=not upper, unit_diagonal=unitriangular, trans=1 if transpose else 0)
    return x, a


@lower("linalg_matrix_exp")
def matrix_exp(a):
    # Scaling and squaring amplifies float32 rounding; computing in double keeps the result within
    # float32 tolerance of the exact exponential.
    dt = _dt()
    wide = jnp.complex128 if jnp.issubdtype(dt, jnp.complexfloating) else jnp.float64
    return jsl.expm(a.astype(wide)).astype(dt)


# Factorizations below are unique only up to signs (phases) of the vectors, so results that depend
# on those signs can differ from LAPACK's; values, reconstructions and sign-free functions of them
# (svdvals, pinv, matrix_rank, nuclear norm, eigvalsh) agree.
@lower("linalg_qr")
def qr(a, mode="reduced"):
    a = a.astype(_dt())
    if mode == "r":
        r = jnp.linalg.qr(a, mode="r")
        return jnp.zeros((0,), a.dtype), r
    return jnp.linalg.qr(a, mode=mode)


@lower("_linalg_eigh")
def eigh(a, UPLO="L", compute_v=True):  # noqa: N803 - the schema's name
    a = a.astype(_dt())
    # LAPACK reads only the UPLO triangle; JAX would symmetrize the whole matrix by default.
    w, v = jnp.linalg.eigh(a, UPLO=UPLO, symmetrize_input=False)
    return w, (v if compute_v else jnp.zeros((0,), a.dtype))


@lower("_linalg_svd")
def svd(a, full_matrices=False, compute_uv=True, *, driver=None):
    a = a.astype(_dt())
    if not compute_uv:
        s = jnp.linalg.svd(a, compute_uv=False)
        return jnp.zeros((0,), a.dtype), s, jnp.zeros((0,), a.dtype)
    u, s, vh = jnp.linalg.svd(a, full_matrices=full_matrices)
    return u, s, vh


# ---- FFT: ATen's three primitives; `normalization` is 0 (none), 1 (1/sqrt(n)) or 2 (1/n) -----------

def _fft_scale(y, n: int, normalization: int):
    if normalization == 1:
        return y / jnp.sqrt(jnp.asarray(n, y.real.dtype)).astype(y.dtype)
    if normalization == 2:
        return y / jnp.asarray(n, y.dtype)
    return y


def _prod(shape, dims) -> int:
    out = 1
    for d in dims:
        out *= shape[d]
    return out


@lower("_fft_c2c")
def fft_c2c(a, dim, normalization, forward):
    dims = [d % a.ndim for d in dim]
    # Unnormalized both ways ("forward" scaling applied to the other direction), scaled below.
    y = jnp.fft.fftn(a, axes=dims) if forward else jnp.fft.ifftn(a, axes=dims, norm="forward")
    return _fft_scale(y, _prod(a.shape, dims), normalization).astype(_dt())


@lower("_fft_r2c")
def fft_r2c(a, dim, normalization, onesided):
    dims = [d % a.ndim for d in dim]
    y = jnp.fft.rfftn(a, axes=dims) if onesided else jnp.fft.fftn(a.astype(_dt()), axes=dims)
    return _fft_scale(y, _prod(a.shape, dims), normalization).astype(_dt())


@lower("_fft_c2r")
def fft_c2r(a, dim, normalization, last_dim_size):
    dims = [d % a.ndim for d in dim]
    sizes = [a.shape[d] for d in dims[:-1]] + [last_dim_size]
    y = jnp.fft.irfftn(a, s=sizes, axes=dims, norm="forward")
    return _fft_scale(y, _prod(ctx().out_shapes[0], dims), normalization).astype(_dt())
