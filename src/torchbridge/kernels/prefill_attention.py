"""Causal attention of prompts computed from their first token, packed: each span attends over its own rows.

q: [N, H, D] and k, v: [N, KVH, D], a step's flat tokens; spans: [S, 2] int64 (first row, row count) of each
prompt, in order and disjoint, count 0 for padding spans (a static count of spans per shape bucket). Row i of
a span sees the span's rows up to i; grouped-query heads share their KV head; rows outside every span give
zeros. Nothing is gathered from the paged cache: a fresh prompt has no context before this step.

On JAX's CPU platform it is the serving engine's C++ kernel as a custom call (host_calls.prefill_attention:
PyTorch's CPU flash attention per span, causal, unpadded), which the engine's device step uses where a padded
group computed every prompt to the group's longest and every row to a bucket (attention.FreshPrefillGroup).
Elsewhere, and for gradients, the jnp reference: one masked softmax over all N x N rows (fine for tests and
small steps; no Pallas form yet, so the engine does not form such groups on TPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from torchbridge.device import host_calls
from torchbridge.kernels import tiling
from torchbridge.kernels.kernel import kernel


def prefill_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, spans: jax.Array,
                                scale: float) -> jax.Array:
    n, h, d = q.shape
    kvh = k.shape[1]
    rows = jnp.arange(n)
    first, count = spans[:, 0], spans[:, 1]
    inside = (rows[None, :] >= first[:, None]) & (rows[None, :] < (first + count)[:, None])  # [S, N]
    span_of = jnp.where(inside.any(0), jnp.argmax(inside, axis=0), -1)  # each row's span, -1 outside
    visible = (span_of[:, None] == span_of[None, :]) & (span_of[:, None] >= 0) & (rows[None, :] <= rows[:, None])
    qg = q.reshape(n, kvh, h // kvh, d).astype(jnp.float32)
    s = jnp.einsum("qkgd,skd->kgqs", qg, k.astype(jnp.float32)) * scale
    s = jnp.where(visible[None, None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(visible[None, None], jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("kgqs,skd->qkgd", p / jnp.where(denom == 0, 1.0, denom), v.astype(jnp.float32))
    return o.reshape(n, h, d).astype(q.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def prefill_attention_host(q: jax.Array, k: jax.Array, v: jax.Array, spans: jax.Array, scale: float) -> jax.Array:
    """The engine's C++ kernel as a custom call (JAX's CPU platform); gradients are the reference's."""
    return host_calls.prefill_attention(q, k, v, spans, scale)


def _host_forward(q, k, v, spans, scale):  # noqa: ANN001, ANN202 - custom_vjp's
    return prefill_attention_host(q, k, v, spans, scale), (q, k, v, spans)


def _host_backward(scale, saved, grad):  # noqa: ANN001, ANN202 - custom_vjp's
    q, k, v, spans = saved
    _, vjp = jax.vjp(lambda a, b, c: prefill_attention_reference(a, b, c, spans, scale), q, k, v)
    return (*vjp(grad), None)


prefill_attention_host.defvjp(_host_forward, _host_backward)


@kernel("torchbridge::prefill_attention", static_argnames=("scale",),
        reference=lambda q, k, v, spans, scale: prefill_attention_reference(q, k, v, spans, scale))
def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, spans: jax.Array, scale: float) -> jax.Array:
    """Causal attention of each span of q's rows over the same rows of k and v; returns [N, H, D]."""
    if tiling.platform() == "cpu" and host_calls.prefill_attention_enabled():
        return prefill_attention_host(q, k, v, spans, scale)
    return prefill_attention_reference(q, k, v, spans, scale)
