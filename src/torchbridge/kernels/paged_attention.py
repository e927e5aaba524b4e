"""Paged attention for decode steps, read straight from the engine's block tables.

One query per sequence, q: [B, H, D]; the layer's cache k_cache/v_cache: [num_blocks, block_size,
KVH, D] (the engine's layout); block_tables: [B, max_blocks] int32 block ids; context_lens: [B]
int32 keys to attend to (positions [0, len)). Grouped-query heads share their KV head. A sequence
with no context returns zeros.

The Pallas kernel walks each sequence's blocks (grid (B, max_blocks)); the block tables and lengths
are scalar-prefetched so each step's index map fetches block `block_tables[b, j]` straight from the
pool (no gathered copy of the context) and an online softmax accumulates across blocks. (The
lengths go in as [B, 1]: a rank-1 operand makes Mosaic's lowering ask for the TPU generation,
which a TPU export from a machine without one cannot answer.) Blocks past
a sequence's length re-use the last fetched block index, so they cost no copy. `impl` as in
rms_norm.py; the jnp reference gathers the blocks and runs a masked softmax.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from torchbridge.device import host_calls
from torchbridge.device.lowerings.moves import as_bits, from_bits
from torchbridge.kernels import tiling
from torchbridge.kernels.kernel import kernel


def paged_attention_reference(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                              context_lens: jax.Array, scale: float) -> jax.Array:
    b, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    length = block_tables.shape[1] * bs
    # (gathered as bits: XLA's CPU backend converts a whole 16-bit cache to float32 to gather from it)
    k = from_bits(as_bits(k_cache)[block_tables], k_cache.dtype).reshape(b, length, kvh, d).astype(jnp.float32)
    v = from_bits(as_bits(v_cache)[block_tables], v_cache.dtype).reshape(b, length, kvh, d).astype(jnp.float32)
    qg = q.reshape(b, kvh, h // kvh, d).astype(jnp.float32)
    s = jnp.einsum("bkgd,bskd->bkgs", qg, k) * scale
    visible = (jnp.arange(length)[None, :] < context_lens[:, None])[:, None, None, :]
    s = jnp.where(visible, s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    p = jnp.where(visible, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    o = jnp.einsum("bkgs,bskd->bkgd", p / jnp.where(denom == 0, 1.0, denom), v)
    return o.reshape(b, h, d).astype(q.dtype)


def paged_attention_pallas(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                           context_lens: jax.Array, scale: float) -> jax.Array:
    b, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    max_blocks = block_tables.shape[1]
    group = h // kvh

    def body(tables_ref, lens_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref):
        seq, j = pl.program_id(0), pl.program_id(1)
        length = lens_ref[seq, 0]

        @pl.when(j == 0)
        def _init():
            m_ref[...] = jnp.full(m_ref.shape, -jnp.inf, jnp.float32)
            l_ref[...] = jnp.zeros(l_ref.shape, jnp.float32)
            acc_ref[...] = jnp.zeros(acc_ref.shape, jnp.float32)

        @pl.when(j * bs < length)
        def _accumulate():
            pos = j * bs + jax.lax.broadcasted_iota(jnp.int32, (1, bs), 1)
            visible = pos < length
            for g in range(kvh):  # each KV head serves its group of query heads
                rows = slice(g * group, (g + 1) * group)
                qh = q_ref[0, rows, :].astype(jnp.float32)  # [group, D]
                kh = k_ref[0, :, g, :].astype(jnp.float32)  # [bs, D]
                vh = v_ref[0, :, g, :].astype(jnp.float32)
                s = jax.lax.dot_general(qh, kh, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
                s = jnp.where(visible, s, -jnp.inf)
                m_prev = m_ref[rows, :]
                m_new = jnp.maximum(m_prev, jnp.max(s, axis=-1, keepdims=True))
                alpha = jnp.exp(m_prev - m_new)
                p = jnp.exp(s - m_new)
                l_ref[rows, :] = alpha * l_ref[rows, :] + jnp.sum(p, axis=-1, keepdims=True)
                acc_ref[rows, :] = alpha * acc_ref[rows, :] + jnp.dot(p, vh, preferred_element_type=jnp.float32)
                m_ref[rows, :] = m_new

        @pl.when(j == max_blocks - 1)
        def _finish():
            denom = l_ref[...]
            o_ref[0] = (acc_ref[...] / jnp.where(denom == 0, 1.0, denom)).astype(o_ref.dtype)

    def kv_block(seq, j, tables, lens):
        # past the context: the block already fetched (lax.div: `//` lowers through sign, which needs a TPU)
        last = jax.lax.div(jnp.maximum(lens[seq, 0] - 1, 0), jnp.int32(bs))
        return tables[seq, jnp.minimum(j, last)], 0, 0, 0

    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=2,
        grid=(b, max_blocks),
        in_specs=[pl.BlockSpec((1, h, d), lambda seq, j, tables, lens: (seq, 0, 0)),
                  pl.BlockSpec((1, bs, kvh, d), kv_block),
                  pl.BlockSpec((1, bs, kvh, d), kv_block)],
        out_specs=pl.BlockSpec((1, h, d), lambda seq, j, tables, lens: (seq, 0, 0)),
        scratch_shapes=[pltpu.VMEM((h, 1), jnp.float32), pltpu.VMEM((h, 1), jnp.float32),
                        pltpu.VMEM((h, d), jnp.float32)],
    )
    return pl.pallas_call(
        body, grid_spec=grid_spec, out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary")),
    )(block_tables.astype(jnp.int32), context_lens.astype(jnp.int32).reshape(b, 1), q, k_cache, v_cache)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def paged_attention_host(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                         context_lens: jax.Array, scale: float) -> jax.Array:
    """On JAX's CPU platform: the serving engine's C++ decode kernel as a custom call (host_calls.paged_decode),
    which reads each row's blocks in place where the reference gathers every row's padded context (and
    XLA:CPU converts it to float32). Gradients are the reference's."""
    return host_calls.paged_decode(q, as_bits(k_cache), as_bits(v_cache), block_tables, context_lens, scale)


def _host_forward(q, k_cache, v_cache, block_tables, context_lens, scale):  # noqa: ANN001, ANN202 - custom_vjp's
    return paged_attention_host(q, k_cache, v_cache, block_tables, context_lens, scale), (q, k_cache, v_cache,
                                                                                          block_tables, context_lens)


def _host_backward(scale, saved, grad):  # noqa: ANN001, ANN202 - custom_vjp's
    q, k_cache, v_cache, block_tables, context_lens = saved
    _, vjp = jax.vjp(lambda a, b, c: paged_attention_reference(a, b, c, block_tables, context_lens, scale),
                     q, k_cache, v_cache)
    return (*vjp(grad), None, None)


paged_attention_host.defvjp(_host_forward, _host_backward)


def _reference_or_host(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                       context_lens: jax.Array, scale: float) -> jax.Array:
    """Off TPU: the engine's kernel where the program is for the CPU platform and it is loaded, else the
    reference."""
    if tiling.platform() == "cpu" and host_calls.paged_decode_enabled():
        return paged_attention_host(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)


@kernel("torchbridge::paged_attention", static_argnames=("scale", "impl"),
        reference=lambda q, kc, vc, bt, cl, scale, impl: paged_attention_reference(q, kc, vc, bt, cl, scale))
def paged_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, block_tables: jax.Array,
                    context_lens: jax.Array, scale: float, impl: str = "auto") -> jax.Array:
    """Decode attention of q [B, H, D] over each sequence's cached blocks; returns [B, H, D]."""
    return tiling.choose(impl, paged_attention_pallas, _reference_or_host, q, k_cache, v_cache, block_tables,
                         context_lens, scale=scale)
