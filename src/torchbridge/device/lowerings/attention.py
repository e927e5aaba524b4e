"""Fused scaled-dot-product attention: PyTorch's PrivateUse1 "overrideable" SDPA op and its backward.

The device answers PyTorch's SDPA backend choice with this op (csrc/native.cpp, where the fused
kernel applies), so `F.scaled_dot_product_attention` is one op in eager mode and in compiled graphs
instead of PyTorch's math decomposition (two batched products, a softmax, the mask and the head
transposes as separate ops, the [L, S] scores materialised). On JAX's CPU platform it runs PyTorch's CPU
flash attention as a custom call (host_calls.attention), the kernel inductor uses; elsewhere it is
the same attention written in JAX, and its backward is jax.vjp of it. Grouped-query attention
(fewer key/value heads) repeats each key/value head for its group and sums their gradients back.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from torchbridge.device import host_calls
from torchbridge.device.lowerings.registry import KERNEL_OVERRIDES, ctx, lower

# PyTorch's own kernels for these only raise "not implemented" (they exist for out-of-tree devices to
# override), and would win over the boxed fallback in eager mode.
KERNEL_OVERRIDES.update({"_scaled_dot_product_fused_attention_overrideable",
                         "_scaled_dot_product_fused_attention_overrideable_backward"})


def _bias(bias, q, k):
    """The mask as an additive float bias broadcast to [B,H,L,S], or None."""
    if bias is None:
        return None
    shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    if bias.dtype == jnp.bool_:
        bias = jnp.where(bias, jnp.zeros((), q.dtype), jnp.array(-jnp.inf, q.dtype))
    return jnp.broadcast_to(bias.astype(q.dtype), shape)


def _repeat_heads(x, heads: int):
    return x if x.shape[1] == heads else jnp.repeat(x, heads // x.shape[1], axis=1)


def _sum_groups(g, heads: int):
    b, h, s, e = g.shape
    return g if h == heads else g.reshape(b, heads, h // heads, s, e).sum(axis=2)


def _math(q, k, v, bias, is_causal: bool, scale: float):
    s = jnp.einsum("bhle,bhse->bhls", q, k) * scale
    if is_causal:
        length, keys = q.shape[2], k.shape[2]
        s = jnp.where(jnp.tril(jnp.ones((length, keys), bool)), s, -jnp.inf)
    if bias is not None:
        s = s + bias
    # a fully masked row attends to nothing: output 0 and no gradient, as PyTorch's math path
    # (_safe_softmax) and CPU flash attention give; its logsumexp is taken over zeros instead of -inf
    # so that no NaN reaches the gradients through the untaken branch
    empty = jnp.all(jnp.isneginf(s), axis=-1, keepdims=True)
    lse = jax.nn.logsumexp(jnp.where(empty, 0.0, s), axis=-1)
    p = jnp.where(empty, 0.0, jnp.exp(s - lse[..., None]))
    return jnp.einsum("bhls,bhse->bhle", p, v), jnp.where(empty[..., 0], -jnp.inf, lse)


def _scale(scale, q) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)


@lower("_scaled_dot_product_fused_attention_overrideable")
def fused_attention(query, key, value, attn_bias=None, dropout_p=0.0, is_causal=False, return_debug_mask=False, *,
                    scale=None):
    heads = query.shape[1]
    k, v = _repeat_heads(key, heads), _repeat_heads(value, heads)
    bias, sc = _bias(attn_bias, query, k), _scale(scale, query)
    if host_calls.enabled():
        out, lse = host_calls.attention(query, k, v, bias, bool(is_causal), sc)
    else:
        out, lse = _math(query, k, v, bias, bool(is_causal), sc)
    seed = jnp.zeros((), jnp.int64)  # no dropout: the philox state is unused
    return out, lse, None, None, query.shape[2], k.shape[2], seed, seed, None


@lower("_scaled_dot_product_fused_attention_overrideable_backward")
def fused_attention_backward(grad_out, query, key, value, attn_bias, grad_input_mask, out, logsumexp, cum_seq_q,
                             cum_seq_k, max_q, max_k, dropout_p, is_causal, philox_seed, philox_offset, *, scale=None):
    heads, kv_heads = query.shape[1], key.shape[1]
    k, v = _repeat_heads(key, heads), _repeat_heads(value, heads)
    has_bias = attn_bias is not None and attn_bias.size > 0
    sc, causal = _scale(scale, query), bool(is_causal)
    out_shapes = ctx().out_shapes
    # PyTorch's CPU flash backward has no bias gradient: when the mask itself needs one (a learned
    # float bias), differentiate the JAX attention instead, with respect to the bias as given (its
    # broadcast is inside the function, so the gradient comes back in the mask's own shape)
    if has_bias and grad_input_mask[3]:
        _, vjp = jax.vjp(lambda q_, k_, v_, b_: _math(q_, k_, v_, _bias(b_, q_, k_), causal, sc)[0],
                         query, k, v, attn_bias)
        gq, gk, gv, gbias = vjp(grad_out)
    else:
        bias = _bias(attn_bias, query, k) if has_bias else None
        if host_calls.enabled():
            gq, gk, gv = host_calls.attention_backward(grad_out, query, k, v, out, logsumexp.astype(query.dtype), bias,
                                                       causal, sc)
        else:
            _, vjp = jax.vjp(lambda q_, k_, v_: _math(q_, k_, v_, bias, causal, sc)[0], query, k, v)
            gq, gk, gv = vjp(grad_out)
        gbias = jnp.zeros(out_shapes[3], query.dtype) if len(out_shapes) > 3 else None
    return gq, _sum_groups(gk, kv_heads), _sum_groups(gv, kv_heads), gbias
