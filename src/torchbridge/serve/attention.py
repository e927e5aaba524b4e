"""Paged attention in plain torch.

The KV cache of one layer is a pair of tensors `[num_blocks + 1, block_size, num_kv_heads, head_dim]`;
the extra last block is scratch space that padding tokens write into, so a padded step never needs a
data-dependent shape. A step's tokens arrive flat (`[N, ...]`, sequences concatenated). Attention runs
per group of sequences: decodes (one query each) in one group, multi-token chunks (prefill, speculative
verification) in another, so that a long prefill does not pad every decode row to its length. Within a
group the queries are scattered into a `[batch, max_query_len]` grid, each sequence's keys and values
are gathered by its block table, and one masked `scaled_dot_product_attention` runs. Every index tensor
is built by the model runner, so shapes depend only on the shape bucket.

Decode steps without shape buckets (cpu, cuda) skip the gather: `DecodeWorkspace` keeps each decoding
sequence's keys and values contiguous (`[rows, num_kv_heads, length, head_dim]` per layer), gathered from
the paged cache once when the sequence starts decoding and then extended by one position per step, so a
decode step reads the context once (inside attention) instead of copying it out of the pool per layer.
The paged cache stays the source of truth (prefix caching, preemption, chunks all use it).

On the CPU the engine's C++ decode kernel (serve/cpu_kernels.py) replaces both: a `PagedDecodeGroup`'s
rows read their keys and values from the pool in place, each only up to its own length. There, too,
prompts computed from their first token form a `FreshPrefillGroup`: each attends over its own new keys
and values (nothing is in the cache before them), one causal call per prompt, unpadded; on the bridge's
device over JAX's CPU platform as well, through the same kernel as a custom call.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
class WorkspaceGroup:
    """Decodes served from the workspace: row r holds the sequence whose new token is query_index[r]."""

    workspace: DecodeWorkspace
    query_index: torch.Tensor  # [R] flat token index of each row's query (and of its new K/V)
    write_index: torch.Tensor  # [R * num_kv_heads] flat (row, head, position) cell of the new K/V
    mask: torch.Tensor  # [R, 1, 1, kv_len] True where the row's query may attend
    kv_len: int  # positions read (the longest context of the step)


@dataclass
class PagedDecodeGroup:
    """Decodes served by the CPU decode kernel straight from the paged cache (one query per row)."""

    query_index: torch.Tensor  # [R] flat token index of each row's query
    block_tables: torch.Tensor  # [R, max_blocks] int64 (past a row's blocks: the scratch block)
    context_lens: torch.Tensor  # [R] int64 keys each row attends to, positions [0, len)
    window: int | None  # sliding window: only the last `window` positions are visible


@dataclass
class FreshPrefillGroup:
    """Prompts computed from their first token (no context in the cache before this step): each attends
    causally over its own new keys and values alone, with no gather from the cache, no mask and no padding
    to the group's longest prompt (the CPU kernels' `prefill_attention`; on the bridge's device its custom
    call, kernels/prefill_attention.py, with a bucketed count of spans)."""

    spans: torch.Tensor  # [S, 2] int64 (first flat token, token count) of each prompt, in order; count 0: padding


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] cache slot each new token's K/V is written to
    groups: list[AttentionGroup | WorkspaceGroup | PagedDecodeGroup | FreshPrefillGroup]


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


class DecodeWorkspace:
    """Contiguous K/V of the sequences decoding this step, one row each, for every layer.

    Rows are handed out per step by `assign`: a sequence keeps its row while it decodes on consecutive
    steps (its row then already holds positions [0, start)); a sequence that stopped decoding (finished,
    preempted, or ran a multi-token chunk) loses it. Rows stay packed at 0..R-1: a row freed below R is
    filled by moving the highest one down. A new row is filled from the paged cache. Capacity grows on
    demand up to `max_tokens` (rows x length); beyond that `assign` returns None and the step gathers.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_rows: int, max_tokens: int) -> None:
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.max_rows, self.max_tokens = max_rows, max_tokens
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.rows = self.length = 0  # capacity
        self.row_of: dict[int, int] = {}  # seq id -> row
        self.filled: dict[int, int] = {}  # seq id -> positions its row holds

    def _grow(self, rows: int, length: int) -> bool:
        if rows <= self.rows and length <= self.length:
            return True
        new_rows = min(max(rows, 2 * self.rows, 8), self.max_rows) if rows > self.rows else self.rows
        new_len = max(length, self.length + self.length // 2, 64) if length > self.length else self.length
        new_len = -(-new_len // 32) * 32
        if new_rows * new_len > self.max_tokens:
            new_rows, new_len = max(rows, self.rows), max(length, self.length)
            if new_rows * new_len > self.max_tokens:
                return False
        shape = (new_rows, self.num_kv_heads, new_len, self.head_dim)

        def grown(old: torch.Tensor | None) -> torch.Tensor:
            new = torch.zeros(shape, dtype=self.dtype, device=self.device)
            if old is not None:
                new[: self.rows, :, : self.length].copy_(old)
            return new

        self.k = [grown(self.k[i] if self.k else None) for i in range(self.num_layers)]
        self.v = [grown(self.v[i] if self.v else None) for i in range(self.num_layers)]
        self.rows, self.length = new_rows, new_len
        return True

    def release_all(self) -> None:
        self.row_of.clear()
        self.filled.clear()

    def assign(self, seq_ids: list[int], starts: list[int], fill: object) -> list[int] | None:
        """Rows (packed 0..R-1) for this step's decodes; seq i's new token goes to position starts[i].
        `fill(row, seq_index, k_layers, v_layers)` copies positions [0, starts[i]) from the paged cache
        into a fresh row. None: over capacity (nothing assigned; the step gathers instead)."""
        r = len(seq_ids)
        live = set(seq_ids)
        for sid in [s for s in self.row_of if s not in live]:
            del self.row_of[sid], self.filled[sid]
        if r > self.max_rows or not self._grow(r, max(starts) + 1):
            self.release_all()
            return None
        free = sorted(set(range(r)) - set(self.row_of.values()))
        for sid, row in list(self.row_of.items()):
            if row >= r:  # move down into a hole below R
                dst, n = free.pop(0), self.filled[sid]
                for buf in (self.k, self.v):
                    for t in buf:
                        t[dst, :, :n].copy_(t[row, :, :n])
                self.row_of[sid] = dst
        rows = []
        for i, (sid, start) in enumerate(zip(seq_ids, starts, strict=True)):
            row = self.row_of.get(sid)
            if row is None:
                row = self.row_of[sid] = free.pop(0)
                self.filled[sid] = 0
            if self.filled[sid] != start:
                fill(row, i, self.k, self.v)
            self.filled[sid] = start + 1
            rows.append(row)
        return rows


def _workspace_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: WorkspaceGroup, layer: int,
                         out: torch.Tensor, scale: float) -> None:
    ws = g.workspace
    num_heads, head_dim = q.shape[1], q.shape[2]
    kvh = ws.num_kv_heads
    r = g.query_index.shape[0]
    kw, vw = ws.k[layer], ws.v[layer]
    kw.view(-1, head_dim).index_copy_(0, g.write_index, k.index_select(0, g.query_index).view(-1, head_dim))
    vw.view(-1, head_dim).index_copy_(0, g.write_index, v.index_select(0, g.query_index).view(-1, head_dim))
    # One query per row: the query heads sharing a KV head become that head's query rows (GQA, no copy).
    qg = q.index_select(0, g.query_index).view(r, kvh, num_heads // kvh, head_dim)
    o = F.scaled_dot_product_attention(qg, kw[:r, :, : g.kv_len], vw[:r, :, : g.kv_len], attn_mask=g.mask, scale=scale)
    out.index_copy_(0, g.query_index, o.reshape(r, num_heads * head_dim))


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    layer: int = 0,
    decode_kernel: Any = None,
    cached: bool = False,
    prefill_kernel: Any = None,
) -> torch.Tensor:
    """q: [N, H, D]; k, v: [N, KVH, D]. Writes k, v into the cache and returns [N, H * D].
    `layer` picks the layer's buffers of a decode workspace. `decode_kernel`: the shipped paged-
    attention kernel (torchbridge.kernels), used for decode groups (one query per row): it reads the
    blocks in place instead of gathering them, and needs each row's keys to be [0, context length).
    `cached`: k and v are in the cache already (the CPU kernels' `rotary_into_cache` wrote them).
    `prefill_kernel`: `prefill_attention(q, k, v, spans, scale)`, which a `FreshPrefillGroup` needs (the CPU
    kernels', or the device's shipped one: the runner forms such groups only where the model has it)."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if not cached:
        # index_copy_/index_select rather than advanced indexing: same result, markedly cheaper on cpu.
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    g0 = meta.groups[0] if len(meta.groups) == 1 else None
    if isinstance(g0, PagedDecodeGroup) and g0.query_index.shape[0] == n:
        # the only group, a row per token (a plain decode step): its rows are the tokens in order (the runner
        # lists decodes in the step's order), so the kernel's output is the result
        from torchbridge.serve.cpu_kernels import paged_decode_attention

        o = paged_decode_attention(q, k_cache, v_cache, g0.block_tables, g0.context_lens, scale, g0.window)
        return o.view(n, num_heads * head_dim)
    # Fresh prompts first: the kernel returns every row (zeros outside its spans), which the other groups'
    # results then go into. One causal call per prompt: a masked call over the group padded every prompt to
    # the longest one's length and computed every padded score (SDPA's CPU kernel skips only what is_causal says).
    fresh = next((g for g in meta.groups if isinstance(g, FreshPrefillGroup)), None)
    if fresh is not None:
        if prefill_kernel is None:
            raise ValueError("paged_attention: a FreshPrefillGroup needs prefill_kernel (the CPU kernels' or the "
                             "device's prefill_attention)")
        o = prefill_kernel(q, k, v, fresh.spans, scale).reshape(n, num_heads * head_dim)
        if len(meta.groups) == 1:
            return o
        out = torch.cat([o, o.new_zeros(1, num_heads * head_dim)])
    else:
        out = q.new_zeros(n + 1, num_heads * head_dim)
    for g in meta.groups:
        if isinstance(g, FreshPrefillGroup):
            continue  # (computed above)
        if isinstance(g, WorkspaceGroup):
            _workspace_attention(q, k, v, g, layer, out, scale)
            continue
        if isinstance(g, PagedDecodeGroup):
            from torchbridge.serve.cpu_kernels import paged_decode_attention

            o = paged_decode_attention(q.index_select(0, g.query_index), k_cache, v_cache, g.block_tables,
                                       g.context_lens, scale, g.window)
            out.index_copy_(0, g.query_index, o.view(-1, num_heads * head_dim))
            continue
        batch, max_q = g.query_index.shape
        if decode_kernel is not None and max_q == 1:
            # a decode row's mask is exactly its context [0, len) (a padding row's: key 0 alone)
            lens = g.mask[:, 0, 0].sum(-1, dtype=torch.int32)
            o = decode_kernel(q.index_select(0, g.query_index.flatten()), k_cache, v_cache, g.block_tables, lens, scale)
            out.index_copy_(0, g.out_tokens, o.reshape(batch, num_heads * head_dim).index_select(0, g.out_cells))
            continue
        # GQA without copying K/V per query head: the G query heads of a KV head become G x T query rows of
        # that head (rows g * T + t), and the mask is repeated for them (repeat_interleave of the gathered
        # K/V was ~100 us per call at a few hundred positions: most of a speculative verify step's attention).
        group = num_heads // num_kv_heads
        qg = q.index_select(0, g.query_index.flatten()).view(batch, max_q, num_kv_heads, group, head_dim)
        qg = qg.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * max_q, head_dim)
        kv_shape = (batch, -1, num_kv_heads, head_dim)
        blocks = g.block_tables.flatten()
        kg = k_cache.index_select(0, blocks).view(kv_shape).transpose(1, 2)  # [B, KVH, L, D]
        vg = v_cache.index_select(0, blocks).view(kv_shape).transpose(1, 2)
        mask = g.mask if group == 1 else g.mask.repeat(1, 1, group, 1)  # [B, 1, G * T, L]
        o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask, scale=scale)  # [B, KVH, G * T, D]
        o = o.view(batch, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
        o = o.reshape(batch * max_q, num_heads * head_dim)
        out.index_copy_(0, g.out_tokens, o.index_select(0, g.out_cells))
    return out[:n]
