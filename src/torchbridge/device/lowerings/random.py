"""Random ops. Each call draws a fresh key from the device RNG stream (seeded by `torch.manual_seed`
through `torch.<device>.manual_seed_all`), so results are reproducible under a seed but are not the
CPU generator's numbers. Half-precision samples are drawn in float32 and rounded, which keeps the
distribution's tails and avoids JAX's coarse low-precision uniform grid.
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


def _uniform(shape, dtype, low=0.0, high=1.0):
    """Samples in [low, high) computed in at least float32."""
    gen = _float_dtype(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.float32
    return jax.random.uniform(ctx().key(), shape, gen, minval=low, maxval=high)


def _normal(shape, dtype):
    gen = _float_dtype(dtype) if jnp.issubdtype(dtype, jnp.floating) else jnp.float32
    return jax.random.normal(ctx().key(), shape, gen)


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
    r = jax.random.randint(ctx().key(), _shape(), low, high, dtype=jnp.int64)
    return r != 0 if dtype == jnp.bool_ else r.astype(dtype)


@lower("exponential", random=True)
def exponential(self, lambd=1.0, *, generator=None):
    return jax.random.exponential(ctx().key(), _shape(), _float_dtype(_dtype())) / lambd


@lower("geometric", random=True)
def geometric(self, p, *, generator=None):
    # Number of Bernoulli(p) trials up to the first success; u in (0, 1) keeps log finite.
    dt = _float_dtype(_dtype()) if jnp.issubdtype(_dtype(), jnp.floating) else jnp.float64
    u = jax.random.uniform(ctx().key(), _shape(), dt, minval=jnp.finfo(dt).tiny, maxval=1.0)
    return jnp.ceil(jnp.log(u) / jnp.log1p(-jnp.asarray(p, dt)))


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
    return jax.random.randint(ctx().key(), _shape(), jnp.asarray(low, jnp.int64), jnp.asarray(high, jnp.int64),
                              dtype=jnp.int64)


@lower("randint", random=True)
def randint(*args, generator=None, **kwargs):
    low, high = (0, args[0]) if isinstance(args[1], (list, tuple)) else (args[0], args[1])
    return jax.random.randint(ctx().key(), _shape(), low, high, dtype=jnp.int64)


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
