"""The multi-class margin losses: multilabel_margin_loss's forward, and both losses' backward ops.

multi_margin_loss's forward reaches the device as PyTorch's decomposition. The backward ops are
`jax.vjp` of the losses written here in JAX after ATen's CPU kernels:

    multi_margin:     loss_n = sum_{c != y_n} w[y_n] * max(0, margin - x[n, y_n] + x[n, c])^p / C
    multilabel_margin: loss_n = sum_{t in targets_n} sum_{c not in targets_n} max(0, 1 - x[n, t] + x[n, c]) / C

targets_n being target[n] up to its first -1 (a repeated target counts as often as it appears). A
hinge exactly at 0 has gradient 0, as the CPU's `z > 0` test gives; `jnp.where` keeps that.
PyTorch has no Meta kernel for either backward op (eager dispatch needs one): grad_input is `self`'s
shape and dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from torchbridge.device.lowerings.nn import _MEAN, _reduce
from torchbridge.device.lowerings.registry import ctx, lower

_NONE = 0


def _grad_of(loss_fn, x, grad_output):
    out, vjp = jax.vjp(loss_fn, x)
    g = grad_output.astype(out.dtype)
    g = g.reshape(out.shape) if g.size == out.size else jnp.broadcast_to(g, out.shape)
    return vjp(g)[0]


@lower("multi_margin_loss_backward")
def multi_margin_loss_backward(grad_output, self, target, p, margin, weight=None, reduction=_MEAN):
    dt = ctx().out_dtypes[0]
    c = self.shape[-1] if self.ndim else 1
    x2 = self.astype(dt).reshape(-1, c)
    y = target.reshape(-1).astype(jnp.int32)
    w = None if weight is None else weight.astype(dt)[y][:, None]
    others = jnp.arange(c)[None, :] != y[:, None]

    def loss(x):
        z = margin - jnp.take_along_axis(x, y[:, None], axis=1) + x
        h = jnp.where(p == 1, z, z * z)
        h = jnp.where(others & (z > 0), h, jnp.zeros((), dt))
        if w is not None:
            h = h * w
        per = jnp.sum(h, axis=1) / c
        return _reduce(per if self.ndim == 2 else per.reshape(()), reduction)

    return _grad_of(loss, x2, grad_output).reshape(self.shape)


def _multilabel_parts(self, target, dt):
    """(x as (N, C), count[n, k]: how often class k is listed among sample n's targets)."""
    c = self.shape[-1] if self.ndim else 1
    x2 = self.astype(dt).reshape(-1, c)
    t = target.reshape(-1, c)
    live = jnp.cumprod((t >= 0).astype(jnp.int32), axis=1) > 0  # entries before the first -1
    count = jnp.sum((t[:, :, None] == jnp.arange(c)[None, None, :]) & live[:, :, None], axis=1).astype(dt)
    return x2, count


def _multilabel_loss(self, count, reduction: int, dt):
    c = count.shape[-1]
    negative = count == 0

    def loss(x):
        z = 1 - x[:, :, None] + x[:, None, :]  # [n, target class, other class]
        h = jnp.where((z > 0) & negative[:, None, :], z, jnp.zeros((), dt))
        per = jnp.sum(count[:, :, None] * h, axis=(1, 2)) / c
        return _reduce(per if self.ndim == 2 else per.reshape(()), reduction)

    return loss


# Lowered rather than left to PyTorch's decomposition, which differs from the CPU kernel for a
# repeated target and for a row whose first entry is -1.
@lower("multilabel_margin_loss_forward")
def multilabel_margin_loss_forward(self, target, reduction):
    dt = ctx().out_dtypes[0]
    x2, count = _multilabel_parts(self, target, dt)
    is_target = (count > 0).astype(ctx().out_dtypes[1]).reshape(ctx().out_shapes[1])
    return _multilabel_loss(self, count, reduction, dt)(x2), is_target


@lower("multilabel_margin_loss_backward")
def multilabel_margin_loss_backward(grad_output, self, target, reduction, is_target):
    dt = ctx().out_dtypes[0]
    x2, count = _multilabel_parts(self, target, dt)
    return _grad_of(_multilabel_loss(self, count, reduction, dt), x2, grad_output).reshape(self.shape)
