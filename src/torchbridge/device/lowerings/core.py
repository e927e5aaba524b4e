"""Core lowerings: copies, creation, arithmetic, matmul, reductions used by nearly every model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from torchbridge.device import host_calls
from torchbridge.device.lowerings.registry import ctx, lower


def out_dtype(i: int = 0):
    return ctx().out_dtypes[i]


def out_shape(i: int = 0):
    return ctx().out_shapes[i]


def _cast_all(*xs, dtype):
    return [jnp.asarray(x).astype(dtype) if x is not None else None for x in xs]


# ---- copies and creation ----
@lower("copy")
def copy(self, src, non_blocking=False):
    return jnp.broadcast_to(jnp.asarray(src), self.shape)


@lower("clone", "alias_copy", "lift_fresh_copy", "_to_copy", "contiguous")
def clone(self, *args, **kwargs):
    return self


@lower("fill")
def fill(self, value):
    return jnp.full(self.shape, value)


@lower("zero")
def zero(self):
    return jnp.zeros(self.shape, self.dtype)


@lower("full")
def full(size, fill_value, **kwargs):
    return jnp.full(out_shape(), fill_value)


# start/end/step fix the output length, so their values must key the program (not be traced).
@lower("arange", static=("start", "end", "step"))
def arange(*args, **kwargs):
    # The length comes from the meta kernel.
    nums = [a for a in args if not isinstance(a, (list, tuple))]
    start, step = 0, 1
    if len(nums) == 1:
        (end,) = nums
    elif len(nums) == 2:
        start, end = nums
    else:
        start, end, step = nums[:3]
    n = out_shape()[0]
    dt = out_dtype()
    if jnp.issubdtype(dt, jnp.integer):
        return (jnp.asarray(start) + jnp.asarray(step) * jnp.arange(n)).astype(dt)
    return jnp.asarray(start, jnp.float64) + jnp.asarray(step, jnp.float64) * jnp.arange(n, dtype=jnp.float64)


# ---- elementwise arithmetic ----
def _promote(a, b, exact_scalar=False):
    dt = out_dtype()
    if dt == jnp.bool_:
        return a, b
    # Half types compute in float32 ("opmath") as in PyTorch's kernels. add/sub round a wider scalar
    # operand to the half type first; mul/div use its exact value (TensorIterator's
    # original_scalar_value). The result is cast back to the half type afterwards.
    if dt in (jnp.float16, jnp.bfloat16):
        if not exact_scalar:
            a, b = _cast_all(a, b, dtype=dt)
        dt = jnp.float32
    return _cast_all(a, b, dtype=dt)


@lower("add")
def add(a, b, alpha=1):
    a, b = _promote(a, b)
    if out_dtype() == jnp.bool_:
        return jnp.logical_or(a, b)
    return a + b * alpha if not (isinstance(alpha, int) and alpha == 1) else a + b


@lower("sub")
def sub(a, b, alpha=1):
    a, b = _promote(a, b)
    return a - b * alpha if not (isinstance(alpha, int) and alpha == 1) else a - b


@lower("rsub")
def rsub(a, b, alpha=1):
    a, b = _promote(a, b)
    return b - a * alpha


@lower("mul")
def mul(a, b):
    if out_dtype() == jnp.bool_:
        return jnp.logical_and(a, b)
    a, b = _promote(a, b, exact_scalar=True)
    return a * b


@lower("div")
def div(a, b, rounding_mode=None):
    dt = out_dtype()
    if rounding_mode is None:
        a, b = _promote(a, b, exact_scalar=True)
        return a / b
    a, b = _cast_all(a, b, dtype=dt)
    if rounding_mode == "trunc":
        if jnp.issubdtype(dt, jnp.integer):
            return lax.div(*jnp.broadcast_arrays(a, b))  # lax ops do not broadcast
        return jnp.trunc(a / b)
    if jnp.issubdtype(dt, jnp.integer):
        return jnp.floor_divide(a, b)
    return jnp.floor(a / b)


@lower("neg")
def neg(a):
    return -a


@lower("reciprocal")
def reciprocal(a):
    return 1 / a.astype(out_dtype())


@lower("pow")
def pow_(a, b):
    dt = out_dtype()
    a, b = _cast_all(a, b, dtype=dt)
    if jnp.issubdtype(dt, jnp.signedinteger):
        # Integer powers with a negative exponent follow C's integer division: 1, +-1 or 0.
        pos = jnp.power(a, jnp.maximum(b, 0))
        neg = jnp.where(a == 1, 1, jnp.where(a == -1, jnp.where(b % 2 == 0, 1, -1), 0)).astype(dt)
        return jnp.where(b < 0, neg, pos)
    return jnp.power(a, b)


# PyTorch's CPU kernel computes these exponents without pow (aten/src/ATen/native/Pow.cpp): the same here.
_SPECIAL_EXPONENTS = {2: lambda a: a * a, 3: lambda a: a * a * a, -1: lambda a: 1 / a, -2: lambda a: 1 / (a * a),
                      0.5: jnp.sqrt, -0.5: lax.rsqrt}


@lower("pow.Tensor_Scalar", static=("exponent",))
def pow_tensor_scalar(a, exponent):
    """The exponent is part of the program (a new exponent compiles a new one), so `x.pow(2)`, in every
    RMSNorm, is one multiply: with the exponent traced it was a general pow, 11x slower inside XLA:CPU's
    reduction fusion (3.8 vs 0.33 ms per Llama forward at batch 1)."""
    dt = out_dtype()
    special = _SPECIAL_EXPONENTS.get(exponent) if type(exponent) in (int, float) else None
    if special is not None and jnp.issubdtype(dt, jnp.floating):
        return special(a.astype(dt))
    return pow_(a, exponent)


@lower("sqrt")
def sqrt(a):
    return jnp.sqrt(a.astype(out_dtype()))


@lower("rsqrt")
def rsqrt(a):
    return lax.rsqrt(a.astype(out_dtype()))


@lower("exp")
def exp(a):
    return jnp.exp(a.astype(out_dtype()))


@lower("log")
def log(a):
    return jnp.log(a.astype(out_dtype()))


@lower("tanh")
def tanh(a):
    return jnp.tanh(a.astype(out_dtype()))


@lower("sigmoid")
def sigmoid(a):
    return jax.nn.sigmoid(a.astype(out_dtype()))


@lower("sin")
def sin(a):
    return jnp.sin(a.astype(out_dtype()))


@lower("cos")
def cos(a):
    return jnp.cos(a.astype(out_dtype()))


@lower("abs")
def abs_(a):
    return jnp.abs(a)


@lower("relu")
def relu(a):
    return jnp.maximum(a, jnp.zeros((), a.dtype))


@lower("gelu")
def gelu(a, approximate="none"):
    return jax.nn.gelu(a, approximate=approximate == "tanh")


@lower("silu")
def silu(a):
    return jax.nn.silu(a)


@lower("where")
def where(cond, a, b):
    dt = out_dtype()
    return jnp.where(cond, jnp.asarray(a).astype(dt), jnp.asarray(b).astype(dt))


@lower("eq")
def eq(a, b):
    return a == b


@lower("ne")
def ne(a, b):
    return a != b


@lower("lt")
def lt(a, b):
    return a < b


@lower("le")
def le(a, b):
    return a <= b


@lower("gt")
def gt(a, b):
    return a > b


@lower("ge")
def ge(a, b):
    return a >= b


@lower("maximum")
def maximum(a, b):
    return jnp.maximum(*_promote(a, b))


@lower("minimum")
def minimum(a, b):
    return jnp.minimum(*_promote(a, b))


@lower("logical_not")
def logical_not(a):
    return jnp.logical_not(a)


@lower("bitwise_not")
def bitwise_not(a):
    return jnp.logical_not(a) if a.dtype == jnp.bool_ else jnp.invert(a)


# ---- matmul ----
@lower("mm", "bmm", "matmul")
def mm(a, b):
    return host_calls.matmul(a, b)


@lower("addmm")
def addmm(bias, a, b, beta=1, alpha=1):
    prod = host_calls.matmul(a, b)
    if not (isinstance(alpha, int) and alpha == 1):
        prod = prod * alpha
    if isinstance(beta, int) and beta == 0:
        return prod
    if not (isinstance(beta, int) and beta == 1):
        bias = bias * beta
    return bias + prod


# ---- reductions ----
def reduction_axes(dim, ndim):
    """Normalized reduction axes; None means all. A 0-dim tensor takes dim 0/-1 and reduces nothing."""
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return None
    if ndim == 0:  # a 0-dim tensor accepts dim 0/-1; reducing over it is the identity
        return None
    if isinstance(dim, int):
        dim = [dim]
    return tuple(d % ndim for d in dim)


@lower("sum")
def sum_(a, dim=None, keepdim=False, *, dtype=None):
    dt = out_dtype()
    return jnp.sum(a.astype(dt), axis=reduction_axes(dim, a.ndim), keepdims=keepdim)


@lower("mean")
def mean(a, dim=None, keepdim=False, *, dtype=None):
    dt = out_dtype()
    return jnp.mean(a.astype(dt), axis=reduction_axes(dim, a.ndim), keepdims=keepdim)


@lower("amax")
def amax(a, dim=(), keepdim=False):
    return jnp.max(a, axis=reduction_axes(dim, a.ndim), keepdims=keepdim)


@lower("amin")
def amin(a, dim=(), keepdim=False):
    return jnp.min(a, axis=reduction_axes(dim, a.ndim), keepdims=keepdim)


@lower("_softmax")
def softmax(a, dim, half_to_float):
    return jax.nn.softmax(a.astype(out_dtype()), axis=dim if a.ndim else None)


@lower("_log_softmax")
def log_softmax(a, dim, half_to_float):
    return jax.nn.log_softmax(a.astype(out_dtype()), axis=dim if a.ndim else None)
