"""Reductions, scans and sorts: prod, var/std, arg/max/min, logsumexp, cumulative ops, norms,
softmax backward, sort/topk/kthvalue/median.

Conventions that differ between NumPy/JAX and PyTorch and are handled here: PyTorch's max/min with a
dim return the *first* index of the extreme value (NaN counts as the extreme), cummax/cummin return
the *last* index, sort is stable and puts NaN last (first when descending), and median returns the
lower of the two middle values.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from jax import lax

from torchbridge.device.lowerings.core import reduction_axes
from torchbridge.device.lowerings.registry import ctx, lower


def out_dtype(i: int = 0):
    return ctx().out_dtypes[i]


# ---- simple reductions ------------------------------------------------------------------------

@lower("prod")
def prod(a, dim=None, keepdim=False, *, dtype=None):
    dt = out_dtype()
    x = a.astype(dt)
    if dt == jnp.bool_:
        return jnp.all(x, axis=reduction_axes(dim, a.ndim), keepdims=keepdim)
    return jnp.prod(x, axis=reduction_axes(dim, a.ndim), keepdims=keepdim)


@lower("nansum")
def nansum(a, dim=None, keepdim=False, *, dtype=None):
    dt = out_dtype()
    x = a.astype(dt)
    if jnp.issubdtype(dt, jnp.floating):
        x = jnp.where(jnp.isnan(x), jnp.zeros_like(x), x)
    return jnp.sum(x, axis=reduction_axes(dim, a.ndim), keepdims=keepdim)


@lower("all")
def all_(a, dim=None, keepdim=False):
    return jnp.all(a != 0, axis=reduction_axes(dim, a.ndim), keepdims=keepdim)


@lower("any")
def any_(a, dim=None, keepdim=False):
    return jnp.any(a != 0, axis=reduction_axes(dim, a.ndim), keepdims=keepdim)


@lower("count_nonzero")
def count_nonzero(a, dim=None):
    return jnp.sum(a != 0, axis=reduction_axes(dim, a.ndim), dtype=jnp.int64)


def _moments(a, dim, correction, keepdim):
    dt = out_dtype()
    x = a.astype(dt)
    axes = reduction_axes(dim, a.ndim)
    n = x.size if axes is None else math.prod(x.shape[i] for i in axes)
    mean = jnp.mean(x, axis=axes, keepdims=True)
    c = 1 if correction is None else correction
    dev = x - mean
    if jnp.issubdtype(dev.dtype, jnp.complexfloating):
        sq = (dev * jnp.conj(dev)).real
    else:
        sq = dev * dev
    # n - correction <= 0 gives inf/nan exactly like PyTorch's division.
    var = jnp.sum(sq, axis=axes, keepdims=keepdim) / jnp.asarray(max(n - c, 0), sq.dtype)
    return var, (mean if keepdim else jnp.squeeze(mean, axis=axes))


def _var_args(args, kwargs):
    """var/std overloads: (self, unbiased) | (self, dim, unbiased, keepdim) | (self, dim, *, correction, keepdim)."""
    dim, correction, keepdim = None, None, kwargs.get("keepdim", False)
    rest = list(args)
    if rest and isinstance(rest[0], bool):  # var(self, bool unbiased)
        correction = 1 if rest[0] else 0
        rest = []
    if rest:
        dim = rest.pop(0)
    if rest:
        unbiased = rest.pop(0)
        if unbiased is not None:
            correction = 1 if unbiased else 0
    if rest:
        keepdim = rest.pop(0)
    if "dim" in kwargs:
        dim = kwargs["dim"]
    if "unbiased" in kwargs and kwargs["unbiased"] is not None:
        correction = 1 if kwargs["unbiased"] else 0
    if kwargs.get("correction") is not None:
        correction = kwargs["correction"]
    return dim, correction, keepdim


@lower("var", static=("correction",))
def var(a, *args, **kwargs):
    dim, correction, keepdim = _var_args(args, kwargs)
    return _moments(a, dim, correction, keepdim)[0]


@lower("std", static=("correction",))
def std(a, *args, **kwargs):
    dim, correction, keepdim = _var_args(args, kwargs)
    return jnp.sqrt(_moments(a, dim, correction, keepdim)[0])


@lower("var_mean", static=("correction",))
def var_mean(a, *args, **kwargs):
    dim, correction, keepdim = _var_args(args, kwargs)
    return _moments(a, dim, correction, keepdim)


@lower("std_mean", static=("correction",))
def std_mean(a, *args, **kwargs):
    dim, correction, keepdim = _var_args(args, kwargs)
    v, m = _moments(a, dim, correction, keepdim)
    return jnp.sqrt(v), m


@lower("logsumexp")
def logsumexp(a, dim, keepdim=False):
    x = a.astype(out_dtype())
    axes = reduction_axes(dim, a.ndim)
    m = jnp.max(x, axis=axes, keepdims=True) if x.size else jnp.zeros((1,) * x.ndim, x.dtype)
    m = jnp.where(jnp.isinf(m), jnp.zeros_like(m), lax.stop_gradient(m))
    s = jnp.log(jnp.sum(jnp.exp(x - m), axis=axes, keepdims=True)) + m
    if keepdim:
        return s
    return s.reshape(()) if axes is None else jnp.squeeze(s, axis=axes)


# ---- norms ------------------------------------------------------------------------------------------

def _magnitude(a):
    """|a| for complex inputs (the norm's real output dtype would drop the imaginary part), else `a`."""
    return jnp.abs(a) if jnp.issubdtype(a.dtype, jnp.complexfloating) else a


def _vector_norm(x, ord_, axes, keepdim):
    x = jnp.abs(x)
    if ord_ == float("inf"):
        return jnp.max(x, axis=axes, keepdims=keepdim)
    if ord_ == float("-inf"):
        return jnp.min(x, axis=axes, keepdims=keepdim)
    if ord_ == 0:
        return jnp.sum((x != 0).astype(x.dtype), axis=axes, keepdims=keepdim)
    if ord_ == 1:
        return jnp.sum(x, axis=axes, keepdims=keepdim)
    if ord_ == 2:
        return jnp.sqrt(jnp.sum(x * x, axis=axes, keepdims=keepdim))
    p = jnp.asarray(ord_, x.dtype)
    return jnp.sum(x**p, axis=axes, keepdims=keepdim) ** (1 / p)


@lower("linalg_vector_norm", static=("ord",))
def linalg_vector_norm(a, ord=2, dim=None, keepdim=False, *, dtype=None):  # noqa: A002
    x = _magnitude(a).astype(out_dtype())
    return _vector_norm(x, float(ord), reduction_axes(dim, a.ndim), keepdim)


@lower("norm", static=("p",))
def norm(a, p=2, dim=None, keepdim=False, *, dtype=None):
    if isinstance(dim, bool):  # norm.ScalarOpt_dtype(self, p, *, dtype) never has dim; guard anyway
        dim = None
    x = _magnitude(a).astype(out_dtype())
    return _vector_norm(x, 2.0 if p is None else float(p), reduction_axes(dim, a.ndim), keepdim)


# ---- max/min with indices ---------------------------------------------------------------------

def _argext(x, axis, largest: bool):
    """First index of the max (min); NaN counts as the extreme, as in PyTorch."""
    if jnp.issubdtype(x.dtype, jnp.floating):
        nan = jnp.isnan(x)
        has_nan = jnp.any(nan, axis=axis, keepdims=True)
        idx = jnp.argmax(x, axis=axis, keepdims=True) if largest else jnp.argmin(x, axis=axis, keepdims=True)
        return jnp.where(has_nan, jnp.argmax(nan, axis=axis, keepdims=True), idx)
    if x.dtype == jnp.bool_:
        x = x.astype(jnp.int8)
    return jnp.argmax(x, axis=axis, keepdims=True) if largest else jnp.argmin(x, axis=axis, keepdims=True)


def _max_min(a, largest: bool, dim=None, keepdim=False):
    if not isinstance(dim, int):  # max(self, other) is the elementwise maximum
        other = dim
        dt = out_dtype()
        a, other = a.astype(dt), jnp.asarray(other).astype(dt)
        return jnp.maximum(a, other) if largest else jnp.minimum(a, other)
    if a.ndim == 0:
        return a, jnp.zeros((), jnp.int64)
    ax = dim % a.ndim
    idx = _argext(a, ax, largest)
    vals = jnp.take_along_axis(a, idx, axis=ax)
    if not keepdim:
        idx, vals = jnp.squeeze(idx, ax), jnp.squeeze(vals, ax)
    return vals, idx.astype(jnp.int64)


@lower("max")
def max_(a, dim=None, keepdim=False):
    if dim is None:
        return jnp.max(a)
    return _max_min(a, True, dim, keepdim)


@lower("min")
def min_(a, dim=None, keepdim=False):
    if dim is None:
        return jnp.min(a)
    return _max_min(a, False, dim, keepdim)


@lower("argmax")
def argmax(a, dim=None, keepdim=False):
    if dim is None:
        idx = _argext(a.reshape(-1), 0, True).reshape(())
        return idx.reshape((1,) * a.ndim) if keepdim else idx
    if a.ndim == 0:
        return jnp.zeros((), jnp.int64)
    idx = _argext(a, dim % a.ndim, True)
    return idx if keepdim else jnp.squeeze(idx, dim % a.ndim)


@lower("argmin")
def argmin(a, dim=None, keepdim=False):
    if dim is None:
        idx = _argext(a.reshape(-1), 0, False).reshape(())
        return idx.reshape((1,) * a.ndim) if keepdim else idx
    if a.ndim == 0:
        return jnp.zeros((), jnp.int64)
    idx = _argext(a, dim % a.ndim, False)
    return idx if keepdim else jnp.squeeze(idx, dim % a.ndim)


@lower("aminmax")
def aminmax(a, *, dim=None, keepdim=False):
    axes = reduction_axes(dim, a.ndim)
    return jnp.min(a, axis=axes, keepdims=keepdim), jnp.max(a, axis=axes, keepdims=keepdim)


# ---- scans ------------------------------------------------------------------------------------------

@lower("cumsum")
def cumsum(a, dim, *, dtype=None):
    x = a.astype(out_dtype())
    return x if a.ndim == 0 else jnp.cumsum(x, axis=dim % a.ndim)


@lower("cumprod")
def cumprod(a, dim, *, dtype=None):
    x = a.astype(out_dtype())
    return x if a.ndim == 0 else jnp.cumprod(x, axis=dim % a.ndim)


@lower("logcumsumexp", "_logcumsumexp")
def logcumsumexp(a, dim):
    x = a.astype(out_dtype())
    return x if a.ndim == 0 else lax.cumlogsumexp(x, axis=dim % a.ndim)


def _cum_ext(a, dim, largest: bool):
    if a.ndim == 0:
        return a, jnp.zeros((), jnp.int64)
    ax = dim % a.ndim
    idx = lax.broadcasted_iota(jnp.int64, a.shape, ax)
    floating = jnp.issubdtype(a.dtype, jnp.floating)

    def combine(left, right):
        (lv, li), (rv, ri) = left, right
        better = rv >= lv if largest else rv <= lv
        if floating:  # a NaN wins and stays: PyTorch keeps the last NaN's index
            better = jnp.isnan(rv) | (~jnp.isnan(lv) & better)
        return jnp.where(better, rv, lv), jnp.where(better, ri, li)

    x = a.astype(jnp.int8) if a.dtype == jnp.bool_ else a
    vals, ids = lax.associative_scan(combine, (x, idx), axis=ax)
    return vals.astype(a.dtype), ids


@lower("cummax")
def cummax(a, dim):
    return _cum_ext(a, dim, True)


@lower("cummin")
def cummin(a, dim):
    return _cum_ext(a, dim, False)


@lower("_cummax_helper", mutates=("values", "indices"))
def cummax_helper(a, values, indices, dim):
    v, i = _cum_ext(a, dim, True)
    return None, {"values": v, "indices": i}


@lower("_cummin_helper", mutates=("values", "indices"))
def cummin_helper(a, values, indices, dim):
    v, i = _cum_ext(a, dim, False)
    return None, {"values": v, "indices": i}


# ---- softmax backward -----------------------------------------------------------------------------

@lower("_softmax_backward_data")
def softmax_backward_data(grad, output, dim, input_dtype):
    dt = out_dtype()
    g, y = grad.astype(dt), output.astype(dt)
    ax = None if y.ndim == 0 else dim % y.ndim
    return y * (g - jnp.sum(g * y, axis=ax, keepdims=True))


@lower("_log_softmax_backward_data")
def log_softmax_backward_data(grad, output, dim, input_dtype):
    dt = out_dtype()
    g, y = grad.astype(dt), output.astype(dt)
    ax = None if y.ndim == 0 else dim % y.ndim
    return g - jnp.exp(y) * jnp.sum(g, axis=ax, keepdims=True)


# ---- sorting ------------------------------------------------------------------------------------------

def _sort(a, ax: int, descending: bool):
    """Stable sort along `ax` with PyTorch's NaN placement. Returns (values, int64 indices)."""
    idx = lax.broadcasted_iota(jnp.int64, a.shape, ax)
    x = a.astype(jnp.int8) if a.dtype == jnp.bool_ else a
    if descending:
        # Reversing, sorting ascending (stably) and reversing back keeps equal elements in their
        # original order, and puts NaN (sorted last) first.
        xr, ir = jnp.flip(x, ax), jnp.flip(idx, ax)
        v, i = lax.sort((xr, ir), dimension=ax, is_stable=True, num_keys=1)
        v, i = jnp.flip(v, ax), jnp.flip(i, ax)
    else:
        v, i = lax.sort((x, idx), dimension=ax, is_stable=True, num_keys=1)
    return v.astype(a.dtype), i


@lower("sort")
def sort(a, *args, **kwargs):
    # sort(self, dim=-1, descending=False) | sort.stable(self, *, stable, dim=-1, descending=False)
    dim = kwargs.get("dim", args[0] if args else -1)
    descending = kwargs.get("descending", args[1] if len(args) > 1 else False)
    if a.ndim == 0:
        return a, jnp.zeros((), jnp.int64)
    return _sort(a, dim % a.ndim, bool(descending))


@lower("argsort")
def argsort(a, *args, **kwargs):
    return sort(a, *args, **kwargs)[1]


@lower("topk")
def topk(a, k, dim=-1, largest=True, sorted=True):  # noqa: A002
    if a.ndim == 0:
        return a, jnp.zeros((), jnp.int64)
    ax = dim % a.ndim
    v, i = _sort(a, ax, descending=bool(largest))
    return lax.slice_in_dim(v, 0, k, axis=ax), lax.slice_in_dim(i, 0, k, axis=ax)


@lower("kthvalue")
def kthvalue(a, k, dim=-1, keepdim=False):
    if a.ndim == 0:
        return a, jnp.zeros((), jnp.int64)
    ax = dim % a.ndim
    v, i = _sort(a, ax, descending=False)
    v, i = lax.slice_in_dim(v, k - 1, k, axis=ax), lax.slice_in_dim(i, k - 1, k, axis=ax)
    return (v, i) if keepdim else (jnp.squeeze(v, ax), jnp.squeeze(i, ax))


def _median(a, dim, keepdim, ignore_nan: bool):
    if dim is None:
        x = a.reshape(-1)
        ax = 0
    elif a.ndim == 0:
        return a, jnp.zeros((), jnp.int64)
    else:
        x, ax = a, dim % a.ndim
    n = x.shape[ax]
    v, i = _sort(x, ax, descending=False)
    if ignore_nan and jnp.issubdtype(x.dtype, jnp.floating):
        # NaNs sort last: the lower median of the non-NaN prefix.
        cnt = jnp.sum(~jnp.isnan(x), axis=ax, keepdims=True)
        k = jnp.maximum((cnt - 1) // 2, 0)
    else:
        k = jnp.full([1 if d == ax else s for d, s in enumerate(x.shape)], (n - 1) // 2, jnp.int64)
        if jnp.issubdtype(x.dtype, jnp.floating):
            # Any NaN makes the median NaN: NaNs sit at the end, point at the first one.
            nan_cnt = jnp.sum(jnp.isnan(x), axis=ax, keepdims=True)
            k = jnp.where(nan_cnt > 0, n - nan_cnt, k)
    vals = jnp.take_along_axis(v, k, axis=ax)
    ids = jnp.take_along_axis(i, k, axis=ax)
    if dim is None:
        return vals.reshape(())
    return (vals, ids) if keepdim else (jnp.squeeze(vals, ax), jnp.squeeze(ids, ax))


@lower("median")
def median(a, dim=None, keepdim=False):
    return _median(a, dim, keepdim, ignore_nan=False)


@lower("nanmedian")
def nanmedian(a, dim=None, keepdim=False):
    return _median(a, dim, keepdim, ignore_nan=True)


# ---- vector/matrix contractions that core.py's mm/bmm/addmm do not cover ----------------------------

def _scaled(x, s):
    # The scalar is converted to the tensor's dtype first (so 0.6 is 0 for integer tensors).
    return x if isinstance(s, int) and s == 1 else x * jnp.asarray(s).astype(x.dtype)


def _plus(bias, prod, beta, alpha):
    prod = _scaled(prod.astype(bias.dtype), alpha)
    if jnp.issubdtype(bias.dtype, jnp.integer):
        beta = int(beta)
    if beta == 0:  # beta=0 ignores bias, even nan/inf in it
        return prod
    return _scaled(bias, beta) + prod


@lower("dot")
def dot(a, b):
    return jnp.dot(a, b)


@lower("vdot")
def vdot(a, b):
    return jnp.vdot(a, b)  # conjugates `a`, like torch.vdot


@lower("mv")
def mv(a, v):
    return jnp.matmul(a, v)


@lower("addmv", static=("beta",))
def addmv(bias, a, v, *, beta=1, alpha=1):
    return _plus(bias.astype(out_dtype()), jnp.matmul(a, v), beta, alpha)


@lower("addr", static=("beta",))
def addr(bias, v1, v2, *, beta=1, alpha=1):
    dt = out_dtype()
    prod = jnp.outer(v1.astype(dt), v2.astype(dt))
    if dt == jnp.bool_:
        return (bias.astype(jnp.bool_) & (beta != 0)) | (prod & (alpha != 0))
    return _plus(bias.astype(dt), prod, beta, alpha)


@lower("baddbmm", static=("beta",))
def baddbmm(bias, a, b, *, beta=1, alpha=1):
    return _plus(bias.astype(out_dtype()), jnp.matmul(a, b), beta, alpha)


@lower("addbmm", static=("beta",))
def addbmm(bias, a, b, *, beta=1, alpha=1):
    return _plus(bias.astype(out_dtype()), jnp.sum(jnp.matmul(a, b), axis=0), beta, alpha)


@lower("mode")
def mode(a, dim=-1, keepdim=False):
    """Most frequent value (the smallest on ties) and the index of its last occurrence."""
    if a.ndim == 0:
        return a, jnp.zeros((), jnp.int64)
    ax = dim % a.ndim
    x = jnp.moveaxis(a, ax, -1)
    v, i = _sort(x, x.ndim - 1, descending=False)
    # Count of each element's value in the row; the best is the first (smallest) value with the
    # highest count.
    eq = v[..., :, None] == v[..., None, :]
    counts = jnp.sum(eq, axis=-1)
    best = jnp.argmax(counts, axis=-1)
    val = jnp.take_along_axis(v, best[..., None], axis=-1)
    # Last original index holding that value.
    idx = jnp.max(jnp.where(x == val, lax.broadcasted_iota(jnp.int64, x.shape, x.ndim - 1), -1), axis=-1)
    val = val[..., 0]
    if keepdim:
        return jnp.expand_dims(val, ax), jnp.expand_dims(idx, ax)
    return val, idx
