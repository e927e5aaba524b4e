"""Paged attention in plain torch.

The KV cache of one layer is a pair of tensors `[num_blocks + 1, block_size, num_kv_heads, head_dim]`;
the extra last block is scratch space that padding tokens write into, so a padded step never needs a
data-dependent shape. A step's tokens arrive flat (`[N, ...]`, sequences concatenated). Attention runs
per group of sequences: decodes (one query each) in one group, multi-token chunks (prefill, speculative
verification) in another, so that a long prefill does not pad every decode row to its length. Within a
group the queries are scattered into a `[batch, max_query_len]` grid, each sequence's keys and values
are gathered by its block table, and one masked `scaled_dot_product_attention` runs. Every index tensor
is built by the model runner, so shapes depend only on the shape bucket.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    query_index: torch.Tensor  # [B, T] flat token index of each grid cell (padding points anywhere)
    block_tables: torch.Tensor  # [B, max_blocks] cache block ids (padding -> scratch block)
    mask: torch.Tensor  # [B, 1, T, max_blocks * block_size] True where a query may attend
    out_tokens: torch.Tensor  # [n] flat index each result goes to (padding -> N, a discarded row)
    out_cells: torch.Tensor  # [n] grid cell (b * T + t) each result comes from


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] cache slot each new token's K/V is written to
    groups: list[AttentionGroup]


def build_mask(
    query_positions: torch.Tensor,
    context_lens: torch.Tensor,
    kv_len: int,
    sliding_window: int | None,
) -> torch.Tensor:
    """Causal mask over the gathered context: key j is visible to a query at position p iff j <= p and j
    is written. Padding rows (context 0) see key 0 so that they never softmax over nothing (NaN)."""
    j = torch.arange(kv_len, device=query_positions.device)
    p = query_positions[:, :, None]
    mask = (j <= p) & (j < context_lens[:, None, None])
    if sliding_window is not None:
        mask &= j > p - sliding_window
    mask |= (j == 0) & (context_lens[:, None, None] == 0)
    return mask[:, None]


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q: [N, H, D]; k, v: [N, KVH, D]. Writes k, v into the cache and returns [N, H * D]."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    # index_copy_/index_select rather than advanced indexing: same result, markedly cheaper on cpu.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = q.new_zeros(n + 1, num_heads * head_dim)
    for g in meta.groups:
        batch, max_q = g.query_index.shape
        qg = q.index_select(0, g.query_index.flatten()).view(batch, max_q, num_heads, head_dim).transpose(1, 2)
        kv_shape = (batch, -1, num_kv_heads, head_dim)
        blocks = g.block_tables.flatten()
        kg = k_cache.index_select(0, blocks).view(kv_shape).transpose(1, 2)  # [B, KVH, L, D]
        vg = v_cache.index_select(0, blocks).view(kv_shape).transpose(1, 2)
        if num_kv_heads != num_heads:
            kg = kg.repeat_interleave(num_heads // num_kv_heads, dim=1)
            vg = vg.repeat_interleave(num_heads // num_kv_heads, dim=1)
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale)
        o = o.transpose(1, 2).reshape(batch * max_q, num_heads * head_dim)
        out.index_copy_(0, g.out_tokens, o.index_select(0, g.out_cells))
    return out[:n]
