"""Random ops. Values are counter-based (registry.TraceContext.bits): element i of an op is a function
of the device's (seed, offset + i) only, so results are reproducible under `torch.manual_seed`, a shard
drawn at its offset equals that part of the whole tensor (DTensor's sharded random init), and they are
not the CPU generator's numbers. Element-wise distributions (uniform, normal, bernoulli, dropout,
integers, exponential, ...) come from each element's own two 32-bit words; permutations and
categorical draws use a key derived from (seed, offset). Half-precision samples are drawn in float32
and rounded, which keeps the distribution's tails and avoids a coarse low-precision grid.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from torchbridge.device.lowerings.registry import ctx, lower


def _shape():
    return tuple(ctx().out_shapes[0])


def _dtype():
    return ctx().out_dtypes[0]


def _float_dtype(dtype):
    return dtype if dtype in (jnp.float32, jnp.float64) else jnp.float32


def _unit(word, dtype, low_word=None):
    """[0, 1) from the high bits of a uint32 word (float32: 24 bits; float64: 53 bits from two words)."""
    if dtype == jnp.float64:
        hi = (word >> 6).astype(jnp.uint64) << 27
        lo = (low_word if low_word is not None else word).astype(jnp.uint64) >> 5
        return (hi | lo).astype(jnp.float64) * (2.0 ** -53)
    return (word >> 8).astype(jnp.float32) * jnp.float32(2.0 ** -24)


def _uniform(shape, dtype, low=0.0, high=1.0):
    """Samples in [low, high) computed in at least float32."""
    gen = _float_dtype(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.float32
    w0, w1 = ctx().bits(shape)
    u = _unit(w0, gen, w1)
    return low + (high - low) * u if (low, high) != (0.0, 1.0) else u


def _normal(shape, dtype):
    """Box-Muller on each element's two words: one standard normal per element."""
    gen = _float_dtype(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.float32
    w0, w1 = ctx().bits(shape)
    u1 = 1.0 - _unit(w0, gen)  # (0, 1]: log is finite
    u2 = _unit(w1, gen)
    return jnp.sqrt(-2.0 * jnp.log(u1)) * jnp.cos(jnp.asarray(2 * math.pi, gen) * u2)


def _integers(shape, low, high):
    """Integers in [low, high) from each element's 64 bits (bias below 2**-32 for ranges under 2**32)."""
    w0, w1 = ctx().bits(shape)
    r = (w0.astype(jnp.uint64) << 32) | w1.astype(jnp.uint64)
    span = (jnp.asarray(high, jnp.int64) - jnp.asarray(low, jnp.int64)).astype(jnp.uint64)
    return jnp.asarray(low, jnp.int64) + (r % jnp.maximum(span, jnp.uint64(1))).astype(jnp.int64)


# ---- in-place fills (also serve their functional forms) ----
@lower("normal.default", "normal_functional", random=True)
def normal_fill(self, mean=0.0, std=1.0, *, generator=None):
    return mean + std * _normal(_shape(), _dtype())


def _normal_tensors(mean, std, *rest, generator=None, **kwargs):
    """normal(mean, std) where either may be a tensor (broadcast) or a float."""
    z = _normal(_shape(), _dtype())
    return jnp.asarray(mean).astype(z.dtype) + jnp.asarray(std).astype(z.dtype) * z


lower("normal.Tensor_float", "normal.float_Tensor", "normal.Tensor_Tensor", "normal.float_float",
      "normal.Tensor_float_out", "normal.float_Tensor_out", "normal.Tensor_Tensor_out", "normal.float_float_out",
      random=True)(_normal_tensors)


@lower("uniform", random=True)
def uniform(self, low=0.0, high=1.0, *, generator=None):
    return _uniform(_shape(), _dtype(), low, high)


@lower("bernoulli", random=True)
def bernoulli(self, p=None, *, generator=None):
    prob = self if p is None else p
    u = _uniform(_shape(), jnp.float64 if jnp.asarray(prob).dtype == jnp.float64 else jnp.float32)
    return u < jnp.asarray(prob).astype(u.dtype)


# bernoulli.p / bernoulli_.float: p defaults to 0.5 in the schema, and a boxed call leaves a default
# argument out, so `x.bernoulli_(0.5)` arrives without p
@lower("bernoulli.p", "bernoulli.float", random=True)
def bernoulli_p(self, p=0.5, *, generator=None):
    return bernoulli(self, p)


def _float_int_range(dtype) -> int:
    """Largest integer random_() draws for a floating dtype: every integer up to 2**digits is exact."""
    digits = {jnp.float16: 11, jnp.bfloat16: 8, jnp.float32: 24, jnp.float64: 53}
    return 2 ** digits[jnp.dtype(dtype).type]


@lower("random", random=True)
def random_(self, *args, generator=None):
    """random_() / random_(to) / random_(from, to): integers in [from, to) (to=None: the dtype's range)."""
    dtype = _dtype()
    if len(args) == 0:
        low, high = 0, None
    elif len(args) == 1:
        low, high = 0, args[0]
    else:
        low, high = args[0], args[1]
    if high is None:
        if dtype == jnp.bool_:
            high = 2
        elif jnp.issubdtype(dtype, jnp.floating):
            high = _float_int_range(dtype) + 1
        else:
            high = int(jnp.iinfo(dtype).max)  # max itself is left out: randint's bound is exclusive
    r = _integers(_shape(), low, high)
    return r != 0 if dtype == jnp.bool_ else r.astype(dtype)


@lower("exponential", random=True)
def exponential(self, lambd=1.0, *, generator=None):
    u = _uniform(_shape(), _float_dtype(_dtype()))
    return -jnp.log1p(-u) / lambd


@lower("geometric", random=True)
def geometric(self, p, *, generator=None):
    # Number of Bernoulli(p) trials up to the first success; u in (0, 1) keeps log finite.
    dt = _float_dtype(_dtype()) if jnp.issubdtype(_dtype(), jnp.floating) else jnp.float64
    u = 1.0 - _uniform(_shape(), dt)  # (0, 1]
    return jnp.maximum(jnp.ceil(jnp.log(u) / jnp.log1p(-jnp.asarray(p, dt))), 1)


@lower("log_normal", random=True)
def log_normal(self, mean=1.0, std=2.0, *, generator=None):
    return jnp.exp(mean + std * _normal(_shape(), _dtype()))


@lower("cauchy", random=True)
def cauchy(self, median=0.0, sigma=1.0, *, generator=None):
    u = _uniform(_shape(), _dtype())
    return median + sigma * jnp.tan(math.pi * (u - 0.5))


# ---- sampling ----
@lower("multinomial", random=True)
def multinomial(self, num_samples, replacement=False, *, generator=None):
    p = self.astype(_float_dtype(self.dtype))
    logp = jnp.log(p)  # zero probability -> -inf: never drawn
    if replacement:
        batch = p.shape[:-1]
        draws = jax.random.categorical(ctx().key(), logp, axis=-1, shape=(num_samples,) + batch)
        return jnp.moveaxis(draws, 0, -1).astype(jnp.int64)
    # Without replacement: the top-k of Gumbel-perturbed log-probabilities is a draw of k distinct
    # categories with exactly the sequential-sampling distribution.
    scores = logp + jax.random.gumbel(ctx().key(), p.shape, p.dtype)
    return lax.top_k(scores, num_samples)[1].astype(jnp.int64)


@lower("randperm", random=True)
def randperm(n, *args, generator=None, **kwargs):
    return jax.random.permutation(ctx().key(), n).astype(_dtype())


# Factories and *_like ops: eager mode reaches them as empty + an in-place fill, compiled graphs as is.
@lower("rand", "rand_like", random=True)
def rand(size, *args, generator=None, **kwargs):
    return _uniform(_shape(), _dtype())


@lower("randn", "randn_like", random=True)
def randn(size, *args, generator=None, **kwargs):
    return _normal(_shape(), _dtype())


@lower("randint_like", random=True)
def randint_like(self, *args, generator=None, **kwargs):
    low, high = (0, args[0]) if len(args) == 1 else (args[0], args[1])
    return _integers(_shape(), low, high)


@lower("randint", random=True)
def randint(*args, generator=None, **kwargs):
    low, high = (0, args[0]) if isinstance(args[1], (list, tuple)) else (args[0], args[1])
    return _integers(_shape(), low, high)


# ---- dropout ----
@lower("native_dropout", random=True)
def native_dropout(input, p, train):
    if train is False:
        return input, jnp.ones(input.shape, jnp.bool_)
    if p >= 1:
        return jnp.zeros_like(input), jnp.zeros(input.shape, jnp.bool_)
    keep = _uniform(input.shape, jnp.float32) >= p
    scale = 1.0 / (1.0 - p)
    return jnp.where(keep, input * jnp.asarray(scale, input.dtype), jnp.zeros((), input.dtype)), keep


@lower("native_dropout_backward")
def native_dropout_backward(grad_output, mask, scale):
    return jnp.where(mask, grad_output * jnp.asarray(scale, grad_output.dtype), jnp.zeros((), grad_output.dtype))
