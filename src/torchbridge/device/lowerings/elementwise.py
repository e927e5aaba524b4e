"""Elementwise math: unary float functions, binary arithmetic, clamps, bit ops, activations and
their backward ops.

Every function computes in the meta kernel's output dtype (`out_dtype()`), so float32 inputs are
computed in float32 as on CPU, and integer inputs of float functions are promoted first. Where
PyTorch's CPU kernel uses a particular formula (lerp, round with decimals, softplus threshold,
the activation backward ops) we use the same formula so results agree to the last few ulp.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import jax.scipy.special as jsp
from jax import lax

from torchbridge.device.lowerings.registry import KERNEL_OVERRIDES, ctx, lower


def out_dtype(i: int = 0):
    return ctx().out_dtypes[i]


def _f(a):
    """`a` in the output dtype (float functions of integer tensors promote first)."""
    return jnp.asarray(a).astype(out_dtype())


def _is_int(dt) -> bool:
    return jnp.issubdtype(dt, jnp.integer) or dt == jnp.bool_


def _both(a, b, dt=None):
    """Both operands in the computation dtype: the output dtype, or for predicates (bool output)
    the promoted dtype of the inputs."""
    dt = dt or out_dtype()
    return jnp.asarray(a).astype(dt), jnp.asarray(b).astype(dt)


# ---- unary float functions --------------------------------------------------------------------

def _unary(name: str, fn) -> None:
    lower(name)(lambda a: fn(_f(a)))


for _name, _fn in {
    "exp2": jnp.exp2, "expm1": jnp.expm1, "log1p": jnp.log1p, "log2": jnp.log2, "log10": jnp.log10,
    "erf": lax.erf, "erfc": lax.erfc, "erfinv": lax.erf_inv,
    "asin": jnp.arcsin, "acos": jnp.arccos, "atan": jnp.arctan, "asinh": jnp.arcsinh, "acosh": jnp.arccosh,
    "atanh": jnp.arctanh, "sinh": jnp.sinh, "cosh": jnp.cosh, "tan": jnp.tan,
    "lgamma": lax.lgamma, "i0": lambda x: lax.bessel_i0e(x) * jnp.exp(jnp.abs(x)),
    "special_i0e": lax.bessel_i0e, "special_i1e": lax.bessel_i1e,
    "special_i1": lambda x: lax.bessel_i1e(x) * jnp.exp(jnp.abs(x)),
    "special_ndtri": jsp.ndtri, "special_ndtr": jsp.ndtr,
    "special_erfcx": jsp.erfcx,
    "special_log_ndtr": jsp.log_ndtr,
    "deg2rad": lambda x: x * jnp.asarray(jnp.pi / 180, x.dtype),
    "rad2deg": lambda x: x * jnp.asarray(180 / jnp.pi, x.dtype),
}.items():
    _unary(_name, _fn)


@lower("digamma")
def digamma(a):
    x = _f(a)
    # PyTorch (like SciPy) returns -inf/+inf at +0/-0 where JAX gives nan.
    return jnp.where(x == 0, jnp.copysign(jnp.asarray(jnp.inf, x.dtype), -x), jsp.digamma(x))


@lower("polygamma")
def polygamma(n, a):
    x = _f(a)
    if n == 0:
        return jnp.where(x == 0, jnp.copysign(jnp.asarray(jnp.inf, x.dtype), -x), jsp.digamma(x))
    # JAX's polygamma (a Hurwitz zeta) is wrong for negative arguments; PyTorch's zeta sums the
    # series there. Shift x up past 0 with the recurrence
    #   psi_n(x) = psi_n(x + m) - (-1)^n n! sum_{k<m} (x + k)^-(n+1).
    # Summed in float64: the alternating shift loses float32 digits near the poles.
    out_dt, x = x.dtype, x.astype(jnp.float64)
    m = jnp.where(x < 0, jnp.ceil(-x), 0)
    sign_fact = jnp.asarray((-1) ** n * math.factorial(n), x.dtype)

    def body(state):
        k, acc = state
        term = jnp.where(k < m, (x + k) ** -(n + 1), jnp.zeros_like(x))
        return k + 1, acc + term

    _, acc = lax.while_loop(lambda st: st[0] < jnp.max(m, initial=0), body, (jnp.zeros((), x.dtype), jnp.zeros_like(x)))
    return (jsp.polygamma(n, x + m) - sign_fact * acc).astype(out_dt)


@lower("mvlgamma")
def mvlgamma(a, p):
    x = _f(a)
    j = jnp.arange(p, dtype=x.dtype)
    const = jnp.asarray(p * (p - 1) / 4 * jnp.log(jnp.pi), x.dtype)
    return const + jnp.sum(lax.lgamma(x[..., None] - j / 2), axis=-1)


@lower("sinc")
def sinc(a):
    x = _f(a)
    px = x * jnp.asarray(jnp.pi, x.dtype)
    return jnp.where(x == 0, jnp.ones_like(x), jnp.sin(px) / jnp.where(x == 0, jnp.ones_like(x), px))


@lower("sign")
def sign(a):
    if a.dtype == jnp.bool_:
        return a
    return jnp.sign(a)


@lower("sgn")
def sgn(a):
    return sign(a)


@lower("signbit")
def signbit(a):
    if a.dtype == jnp.bool_:
        return jnp.zeros(a.shape, jnp.bool_)
    return jnp.signbit(a)


@lower("floor")
def floor(a):
    return a if _is_int(a.dtype) else jnp.floor(a)


@lower("ceil")
def ceil(a):
    return a if _is_int(a.dtype) else jnp.ceil(a)


@lower("trunc")
def trunc(a):
    return a if _is_int(a.dtype) else jnp.trunc(a)


@lower("frac")
def frac(a):
    return a - jnp.trunc(a)


@lower("round")
def round_(a, *, decimals=0):
    if _is_int(a.dtype):
        return a
    if decimals == 0:
        return jnp.round(a)  # half to even, like nearbyint
    # PyTorch's formula: the power of ten is formed in the tensor's dtype, and for negative
    # decimals it divides first.
    if decimals > 0:
        p = jnp.asarray(10.0**decimals, a.dtype)
        return jnp.round(a * p) / p
    p = jnp.asarray(10.0 ** (-decimals), a.dtype)
    return jnp.round(a / p) * p


@lower("angle")
def angle(a):
    if jnp.issubdtype(a.dtype, jnp.complexfloating):
        return jnp.angle(a)
    x = _f(a)
    return jnp.where(jnp.isnan(x), x, jnp.where(x < 0, jnp.asarray(jnp.pi, x.dtype), jnp.zeros_like(x)))


@lower("positive")
def positive(a):
    return a


@lower("complex")
def complex_(real, imag):
    dt = ctx().out_dtypes[0]
    part = jnp.real(jnp.zeros((), dt)).dtype
    return lax.complex(*jnp.broadcast_arrays(real.astype(part), imag.astype(part)))  # lax does not broadcast


@lower("polar")
def polar(magnitude, angle):
    return lax.complex(magnitude * jnp.cos(angle), magnitude * jnp.sin(angle))


# conj_physical_'s generic kernel calls the CPU/CUDA kernel stub directly: give it a device kernel.
KERNEL_OVERRIDES.add("conj_physical_")


@lower("conj_physical", "_conj_physical")
def conj_physical(a):
    # The input's own conj/neg bits are resolved before we get here (fallback.py: math bits).
    return jnp.conj(a) if jnp.issubdtype(a.dtype, jnp.complexfloating) else a


def _float_predicate(fn, otherwise: bool):
    """A float-classification lowering; integer and bool tensors have no nan/inf, so the answer is fixed."""

    def lowering(a):
        return fn(a) if jnp.issubdtype(a.dtype, jnp.floating) else jnp.full(a.shape, otherwise, jnp.bool_)

    return lowering


for _name, _fn, _otherwise in (("isnan", jnp.isnan, False), ("isinf", jnp.isinf, False),
                               ("isposinf", jnp.isposinf, False), ("isneginf", jnp.isneginf, False),
                               ("isfinite", jnp.isfinite, True)):
    lower(_name)(_float_predicate(_fn, _otherwise))


@lower("nan_to_num")
def nan_to_num(a, nan=None, posinf=None, neginf=None):
    if not jnp.issubdtype(a.dtype, jnp.floating):
        return a
    info = jnp.finfo(a.dtype)
    nan = 0.0 if nan is None else nan
    posinf = info.max if posinf is None else posinf
    neginf = info.min if neginf is None else neginf
    a = jnp.where(jnp.isnan(a), jnp.asarray(nan).astype(a.dtype), a)
    a = jnp.where(jnp.isposinf(a), jnp.asarray(posinf).astype(a.dtype), a)
    return jnp.where(jnp.isneginf(a), jnp.asarray(neginf).astype(a.dtype), a)


# ---- binary arithmetic ------------------------------------------------------------------------

def _binary(fn):
    """A lowering that applies `fn` to both operands cast to the computation dtype."""

    def lowering(a, b):
        return fn(*_both(a, b))

    return lowering


_BINARY = {
    "atan2": jnp.arctan2,
    "hypot": jnp.hypot,
    "copysign": jnp.copysign,
    "nextafter": jnp.nextafter,
    "floor_divide": jnp.floor_divide,
    "fmax": jnp.fmax,
    "fmin": jnp.fmin,
    "logaddexp": jnp.logaddexp,
    "logaddexp2": jnp.logaddexp2,
    "float_power": jnp.power,
    "gcd": jnp.gcd,
}
for _name, _fn in _BINARY.items():
    lower(_name)(_binary(_fn))


@lower("fmod")
def fmod(a, b):
    a, b = _both(a, b)
    if _is_int(a.dtype):
        return lax.rem(*jnp.broadcast_arrays(a, b))  # C semantics: the sign of the dividend
    return jnp.fmod(a, b)


@lower("remainder")
def remainder(a, b):
    a, b = _both(a, b)
    if _is_int(a.dtype):
        return jnp.remainder(a, b)  # Python semantics: the sign of the divisor
    # PyTorch's CPU formula: a - b * floor(a / b); keeps its rounding (jnp.remainder uses fmod).
    mod = jnp.fmod(a, b)
    return jnp.where((mod != 0) & ((b < 0) != (mod < 0)), mod + b, mod)


@lower("heaviside")
def heaviside(a, b):
    a, b = _both(a, b)
    zero = jnp.zeros((), a.dtype)
    return jnp.where(a == 0, b, (a > zero).astype(a.dtype))


@lower("xlogy")
def xlogy(a, b):
    a, b = _both(a, b)
    res = jnp.where(a == 0, jnp.zeros_like(a * b), a * jnp.log(b))
    return jnp.where(jnp.isnan(b), b, res)


@lower("special_xlog1py")
def xlog1py(a, b):
    a, b = _both(a, b)
    res = jnp.where(a == 0, jnp.zeros_like(a * b), a * jnp.log1p(b))
    return jnp.where(jnp.isnan(b), b, res)


@lower("lerp")
def lerp(a, end, weight):
    dt = out_dtype()
    a, end = _both(a, end, dt)
    w = jnp.asarray(weight).astype(dt)
    # PyTorch's two-sided formula: exact at both ends.
    diff = end - a
    return jnp.where(jnp.abs(w) < 0.5, a + w * diff, end - diff * (1 - w))


@lower("addcmul")
def addcmul(a, t1, t2, value=1):
    dt = out_dtype()
    a, t1 = _both(a, t1, dt)
    t2 = jnp.asarray(t2).astype(dt)
    if dt == jnp.bool_:
        return a | (t1 & t2 & jnp.asarray(value).astype(jnp.bool_))
    return a + jnp.asarray(value).astype(dt) * t1 * t2


@lower("addcdiv")
def addcdiv(a, t1, t2, value=1):
    dt = out_dtype()
    a, t1 = _both(a, t1, dt)
    t2 = jnp.asarray(t2).astype(dt)
    return a + jnp.asarray(value).astype(dt) * (t1 / t2)


# ---- clamps -------------------------------------------------------------------------------------

def _clamp(a, lo, hi):
    dt = out_dtype()
    a = jnp.asarray(a).astype(dt)
    # min first, then max: with lo > hi every element becomes hi, as in PyTorch; NaN propagates.
    if lo is not None:
        a = jnp.maximum(a, jnp.asarray(lo).astype(dt))
    if hi is not None:
        a = jnp.minimum(a, jnp.asarray(hi).astype(dt))
    return a


@lower("clamp", "clip")
def clamp(a, min=None, max=None):  # noqa: A002 - the schema's names
    return _clamp(a, min, max)


@lower("clamp_min")
def clamp_min(a, min):  # noqa: A002
    return _clamp(a, min, None)


@lower("clamp_max")
def clamp_max(a, max):  # noqa: A002
    return _clamp(a, None, max)


# ---- logical and bitwise -------------------------------------------------------------------------

@lower("logical_and")
def logical_and(a, b):
    return jnp.logical_and(a != 0, b != 0)


@lower("logical_or")
def logical_or(a, b):
    return jnp.logical_or(a != 0, b != 0)


@lower("logical_xor")
def logical_xor(a, b):
    return jnp.logical_xor(a != 0, b != 0)


def _bitwise(fn):
    def impl(a, b):
        a, b = _both(a, b)
        return fn(a, b)

    return impl


lower("bitwise_and", "__and__")(_bitwise(jnp.bitwise_and))
lower("bitwise_or", "__or__")(_bitwise(jnp.bitwise_or))
lower("bitwise_xor", "__xor__")(_bitwise(jnp.bitwise_xor))


@lower("bitwise_left_shift", "__lshift__")
def left_shift(a, b):
    a, b = _both(a, b)
    if not _is_int(a.dtype):  # __lshift__ on floats multiplies by 2**b
        return a * jnp.exp2(b)
    bits = jnp.iinfo(a.dtype).bits
    # Shifting by >= the bit width (or a negative amount) gives 0 in PyTorch.
    ok = (b >= 0) & (b < bits)
    return jnp.where(ok, jnp.left_shift(a, jnp.where(ok, b, 0)), jnp.zeros_like(a))


@lower("bitwise_right_shift", "__rshift__")
def right_shift(a, b):
    a, b = _both(a, b)
    if not _is_int(a.dtype):
        return a / jnp.exp2(b)
    bits = jnp.iinfo(a.dtype).bits
    # Over-wide shifts saturate: all sign bits (arithmetic shift of signed types).
    sh = jnp.where((b < 0) | (b >= bits), bits - 1, b)
    res = jnp.right_shift(a, sh)
    if jnp.issubdtype(a.dtype, jnp.unsignedinteger):
        res = jnp.where((b < 0) | (b >= bits), jnp.zeros_like(a), res)
    return res


# ---- activations --------------------------------------------------------------------------------

@lower("leaky_relu")
def leaky_relu(a, negative_slope=0.01):
    x = _f(a)
    return jnp.where(x > 0, x, x * jnp.asarray(negative_slope).astype(x.dtype))


@lower("elu")
def elu(a, alpha=1, scale=1, input_scale=1):
    x = _f(a)
    alpha, scale, input_scale = (jnp.asarray(v).astype(x.dtype) for v in (alpha, scale, input_scale))
    return jnp.where(x > 0, x * scale, jnp.expm1(x * input_scale) * alpha * scale)


@lower("hardtanh")
def hardtanh(a, min_val=-1, max_val=1):
    return _clamp(a, min_val, max_val)


@lower("hardsigmoid")
def hardsigmoid(a):
    x = _f(a)
    return jnp.clip(x + 3, 0, 6) / 6


@lower("hardswish")
def hardswish(a):
    x = _f(a)
    return x * jnp.clip(x + 3, 0, 6) / 6


@lower("softplus")
def softplus(a, beta=1, threshold=20):
    x = _f(a)
    beta = jnp.asarray(beta).astype(x.dtype)
    xb = x * beta
    return jnp.where(xb > threshold, x, jnp.log1p(jnp.exp(xb)) / beta)


@lower("mish")
def mish(a):
    x = _f(a)
    return x * jnp.tanh(jax.nn.softplus(x))


@lower("logit")
def logit(a, eps=None):
    x = _f(a)
    if eps is not None:
        e = jnp.asarray(eps).astype(x.dtype)
        x = jnp.clip(x, e, 1 - e)
    return jnp.log(x / (1 - x))


@lower("log_sigmoid_forward")
def log_sigmoid_forward(a):
    x = _f(a)
    # Returns (output, buffer); the buffer is only read by our own backward, which recomputes.
    return -jax.nn.softplus(-x), jnp.zeros_like(x)


@lower("hardshrink")
def hardshrink(a, lambd=0.5):
    x = _f(a)
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros_like(x), x)


@lower("softshrink")
def softshrink(a, lambd=0.5):
    x = _f(a)
    lam = jnp.asarray(lambd).astype(x.dtype)
    return jnp.where(x > lam, x - lam, jnp.where(x < -lam, x + lam, jnp.zeros_like(x)))


@lower("threshold")
def threshold(a, threshold, value):
    dt = out_dtype()
    x = jnp.asarray(a).astype(dt)
    return jnp.where(x <= threshold, jnp.asarray(value).astype(dt), x)


# ---- activation backward ops ------------------------------------------------------------------

@lower("threshold_backward")
def threshold_backward(grad, a, threshold):
    g = _f(grad)
    return jnp.where(a <= threshold, jnp.zeros_like(g), g)


@lower("sigmoid_backward")
def sigmoid_backward(grad, out):
    g, y = _both(grad, out)
    return g * (1 - y) * y


@lower("tanh_backward")
def tanh_backward(grad, out):
    g, y = _both(grad, out)
    return g * (1 - y * y)


@lower("gelu_backward")
def gelu_backward(grad, a, approximate="none"):
    g, x = _both(grad, a)
    if approximate == "tanh":
        k = jnp.asarray(0.7978845608028654, x.dtype)  # sqrt(2/pi)
        c = jnp.asarray(0.044715, x.dtype)
        inner = k * (x + c * x * x * x)
        t = jnp.tanh(inner)
        dinner = k * (1 + 3 * c * x * x)
        return g * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * dinner)
    cdf = 0.5 * (1 + lax.erf(x * jnp.asarray(0.7071067811865476, x.dtype)))
    pdf = jnp.exp(-0.5 * x * x) * jnp.asarray(0.3989422804014327, x.dtype)
    return g * (cdf + x * pdf)


@lower("silu_backward")
def silu_backward(grad, a):
    g, x = _both(grad, a)
    s = jax.nn.sigmoid(x)
    return g * s * (1 + x * (1 - s))


@lower("mish_backward")
def mish_backward(grad, a):
    g, x = _both(grad, a)
    s = jax.nn.sigmoid(x)
    t = jnp.tanh(jax.nn.softplus(x))
    return g * (t + x * s * (1 - t * t))


@lower("leaky_relu_backward")
def leaky_relu_backward(grad, a, negative_slope, self_is_result):
    g, x = _both(grad, a)
    return jnp.where(x > 0, g, g * jnp.asarray(negative_slope).astype(g.dtype))


@lower("elu_backward")
def elu_backward(grad, alpha, scale, input_scale, is_result, self_or_result):
    g, x = _both(grad, self_or_result)
    alpha, scale, input_scale = (jnp.asarray(v).astype(g.dtype) for v in (alpha, scale, input_scale))
    if is_result:
        neg = g * input_scale * (x + alpha * scale)
    else:
        neg = g * input_scale * alpha * scale * jnp.exp(x * input_scale)
    return jnp.where(x <= 0, neg, g * scale)


@lower("hardtanh_backward")
def hardtanh_backward(grad, a, min_val, max_val):
    g, x = _both(grad, a)
    return jnp.where((x <= min_val) | (x >= max_val), jnp.zeros_like(g), g)


@lower("hardsigmoid_backward")
def hardsigmoid_backward(grad, a):
    g, x = _both(grad, a)
    return jnp.where((x > -3) & (x < 3), g / 6, jnp.zeros_like(g))


@lower("hardswish_backward")
def hardswish_backward(grad, a):
    g, x = _both(grad, a)
    return jnp.where(x < -3, jnp.zeros_like(g), jnp.where(x <= 3, g * (x / 3 + 0.5), g))


@lower("softplus_backward")
def softplus_backward(grad, a, beta, threshold):
    g, x = _both(grad, a)
    beta = jnp.asarray(beta).astype(x.dtype)
    z = jnp.exp(x * beta)
    return jnp.where(x * beta > threshold, g, g * z / (z + 1))


@lower("logit_backward")
def logit_backward(grad, a, eps=None):
    g, x = _both(grad, a)
    d = g / (x * (1 - x))
    if eps is None:
        return jnp.where((x < 0) | (x > 1), jnp.full_like(g, jnp.nan), d)
    e = jnp.asarray(eps).astype(x.dtype)
    return jnp.where((x < e) | (x > 1 - e), jnp.zeros_like(g), d)


@lower("log_sigmoid_backward")
def log_sigmoid_backward(grad, a, buffer):
    g, x = _both(grad, a)
    return g * jax.nn.sigmoid(-x)


@lower("hardshrink_backward")
def hardshrink_backward(grad, a, lambd):
    g, x = _both(grad, a)
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros_like(g), g)


@lower("softshrink_backward")
def softshrink_backward(grad, a, lambd):
    g, x = _both(grad, a)
    return jnp.where((x >= -lambd) & (x <= lambd), jnp.zeros_like(g), g)



# ---- more special functions ---------------------------------------------------------------------

@lower("frexp")
def frexp(a):
    m, e = jnp.frexp(a)
    return m, e.astype(jnp.int32)


@lower("igamma")
def igamma(a, x):
    a, x = jnp.broadcast_arrays(*_both(a, x))
    return lax.igamma(a, x)


@lower("igammac")
def igammac(a, x):
    a, x = jnp.broadcast_arrays(*_both(a, x))
    return lax.igammac(a, x)


@lower("special_zeta")
def zeta(x, q):
    x, q = _both(x, q)
    return jsp.zeta(x, q)


@lower("special_entr")
def entr(a):
    x = _f(a)
    res = jnp.where(x > 0, -x * jnp.log(jnp.where(x > 0, x, 1)), jnp.where(x == 0, 0, -jnp.inf))
    return jnp.where(jnp.isnan(x), x, res).astype(x.dtype)


def _poly(name: str, shift: bool, first, step):
    """Orthogonal polynomials by their three-term recurrence, p_{k+1} = step(k, x, p_k, p_{k-1}),
    run to the largest degree in `n` (negative degrees give 0, as in PyTorch)."""

    def impl(x, n):
        dt = out_dtype()
        # PyTorch truncates a floating degree to an integer.
        x, n = jnp.asarray(x).astype(dt), jnp.trunc(jnp.asarray(n)).astype(dt)
        if shift:
            x = 2 * x - 1
        x, n = jnp.broadcast_arrays(x, n)
        p0, p1 = jnp.ones_like(x), first(x)
        top = jnp.max(n, initial=0)

        def body(state):
            k, prev, cur, out = state
            nxt = step(k, x, cur, prev)
            out = jnp.where(n == k + 1, nxt, out)
            return k + 1, cur, nxt, out

        out = jnp.where(n == 0, p0, jnp.where(n == 1, p1, jnp.zeros_like(x)))
        _, _, _, out = lax.while_loop(lambda st: st[0] + 1 <= top, body, (jnp.ones((), dt), p0, p1, out))
        return jnp.where(n < 0, jnp.zeros_like(out), out)

    lower(name)(impl)


_cheb = lambda k, x, cur, prev: 2 * x * cur - prev  # noqa: E731
_poly("special_chebyshev_polynomial_t", False, lambda x: x, _cheb)
_poly("special_chebyshev_polynomial_u", False, lambda x: 2 * x, _cheb)
_poly("special_chebyshev_polynomial_v", False, lambda x: 2 * x - 1, _cheb)
_poly("special_chebyshev_polynomial_w", False, lambda x: 2 * x + 1, _cheb)
_poly("special_shifted_chebyshev_polynomial_t", True, lambda x: x, _cheb)
_poly("special_shifted_chebyshev_polynomial_u", True, lambda x: 2 * x, _cheb)
_poly("special_shifted_chebyshev_polynomial_v", True, lambda x: 2 * x - 1, _cheb)
_poly("special_shifted_chebyshev_polynomial_w", True, lambda x: 2 * x + 1, _cheb)
_poly("special_hermite_polynomial_h", False, lambda x: 2 * x, lambda k, x, cur, prev: 2 * x * cur - 2 * k * prev)
_poly("special_hermite_polynomial_he", False, lambda x: x, lambda k, x, cur, prev: x * cur - k * prev)
_poly("special_laguerre_polynomial_l", False, lambda x: 1 - x,
      lambda k, x, cur, prev: ((2 * k + 1 - x) * cur - k * prev) / (k + 1))
_poly("special_legendre_polynomial_p", False, lambda x: x,
      lambda k, x, cur, prev: ((2 * k + 1) * x * cur - k * prev) / (k + 1))


# Autograd's gradient for ops like sgn is a "zero tensor"; here it is plain zeros.
@lower("_efficientzerotensor")
def efficientzerotensor(size, *, dtype=None, layout=None, device=None, pin_memory=None):
    return jnp.zeros(ctx().out_shapes[0], out_dtype())


_unary("special_modified_bessel_i0", lambda x: lax.bessel_i0e(x) * jnp.exp(jnp.abs(x)))
_unary("special_modified_bessel_i1", lambda x: lax.bessel_i1e(x) * jnp.exp(jnp.abs(x)))


@lower("special_spherical_bessel_j0")
def spherical_bessel_j0(a):
    x = _f(a)
    safe = jnp.where(x == 0, jnp.ones_like(x), x)
    return jnp.where(x == 0, jnp.ones_like(x), jnp.sin(safe) / safe)
