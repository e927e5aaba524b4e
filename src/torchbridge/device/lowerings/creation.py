"""Factory ops as they appear in compiled graphs (eager runs most of them as empty + fill_)."""

from __future__ import annotations

import jax.numpy as jnp

from torchbridge.device.lowerings.registry import ctx, lower


def _like():
    return ctx().out_shapes[0], ctx().out_dtypes[0]


@lower("scalar_tensor")
def scalar_tensor(s, **kwargs):
    return jnp.asarray(s).astype(ctx().out_dtypes[0])


@lower("empty.memory_format", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "zeros", "zeros_like",
       "new_zeros")
def zeros(*args, **kwargs):
    shape, dt = _like()
    return jnp.zeros(shape, dt)


@lower("ones", "ones_like", "new_ones")
def ones(*args, **kwargs):
    shape, dt = _like()
    return jnp.ones(shape, dt)


@lower("full_like")
def full_like(a, fill_value, *args, **kwargs):
    shape, dt = _like()
    return jnp.full(shape, fill_value).astype(dt)


@lower("new_full")
def new_full(a, size, fill_value, *args, **kwargs):
    shape, dt = _like()
    return jnp.full(shape, fill_value).astype(dt)
