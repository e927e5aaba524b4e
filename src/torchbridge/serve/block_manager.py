"""Paged KV-cache blocks: reference counts, a prefix cache keyed by chained block hashes, LRU eviction.

A full block i of a sequence is identified by h_i = xxh64(le64(h_{i-1}) || le32(tokens of block i)),
h_{-1} = 0, so equal hashes mean equal whole prefixes. Blocks whose last reference is dropped stay in
the cache (and in `hash_to_block`) until the allocator needs them; the free queue evicts blocks without a
hash first, then hashed ones least recently freed first, the tail of a freed chain before its head.
"""

from __future__ import annotations

import collections
import math

from torchbridge.block_hash import block_hash
from torchbridge.serve.kv_events import KVEventLog
from torchbridge.serve.sequence import Sequence

__all__ = ["BlockManager", "block_hash"]


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        events: KVEventLog | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.events = events
        self.ref_counts = [0] * num_blocks
        self.hashes: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free: collections.OrderedDict[int, None] = collections.OrderedDict.fromkeys(range(num_blocks))
        # Prefix-cache counters in tokens, like vLLM's vllm:prefix_cache_{queries,hits}.
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def _seq_hash(self, seq: Sequence, i: int) -> int:
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[j - 1] if j else 0
            seq.block_hashes.append(block_hash(parent, seq.token_ids[j * self.block_size : (j + 1) * self.block_size]))
        return seq.block_hashes[i]

    def lookup(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq. At least one token is left uncached so that the step
        that finishes the prompt produces logits."""
        if not self.enable_prefix_caching:
            return []
        blocks = []
        for i in range((len(seq.token_ids) - 1) // self.block_size):
            b = self.hash_to_block.get(self._seq_hash(seq, i))
            if b is None:
                break
            blocks.append(b)
        return blocks

    def record_lookup(self, seq: Sequence, num_hit_tokens: int) -> None:
        self.prefix_queries += len(seq.token_ids)
        self.prefix_hits += num_hit_tokens

    def can_take(self, cached: list[int], num_tokens: int) -> bool:
        reviving = sum(1 for b in cached if self.ref_counts[b] == 0)
        return self.blocks_for(num_tokens) - len(cached) + reviving <= len(self.free)

    def take_cached(self, seq: Sequence, cached: list[int]) -> None:
        assert not seq.block_table
        for b in cached:
            if self.ref_counts[b] == 0:
                del self.free[b]
            self.ref_counts[b] += 1
        seq.block_table = list(cached)
        seq.num_computed_tokens = seq.num_hashed_blocks = len(cached)
        seq.num_computed_tokens *= self.block_size

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's block table to hold num_tokens; False (and no change) if the pool is short."""
        needed = self.blocks_for(num_tokens) - len(seq.block_table)
        if needed > len(self.free):
            return False
        for _ in range(max(needed, 0)):
            b, _ = self.free.popitem(last=False)
            self._evict(b)
            self.ref_counts[b] = 1
            seq.block_table.append(b)
        return True

    def _evict(self, b: int) -> None:
        h = self.hashes[b]
        if h is None:
            return
        self.hashes[b] = None
        if self.hash_to_block.get(h) == b:
            del self.hash_to_block[h]
            if self.events is not None:
                self.events.record("removed", block_hashes=[h])

    def release(self, seq: Sequence) -> None:
        for b in reversed(seq.block_table):
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free[b] = None
                if self.hashes[b] is None:
                    self.free.move_to_end(b, last=False)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def commit(self, seq: Sequence) -> None:
        """Publish seq's newly completed full blocks to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        run: list[int] = []
        parent: int | None = None
        while (seq.num_hashed_blocks + 1) * self.block_size <= seq.num_computed_tokens:
            i = seq.num_hashed_blocks
            h, b = self._seq_hash(seq, i), seq.block_table[i]
            if h not in self.hash_to_block and self.hashes[b] is None:
                self.hash_to_block[h] = b
                self.hashes[b] = h
                if not run:
                    parent = self._seq_hash(seq, i - 1) if i else None
                run.append(h)
            else:
                # Another block already holds this prefix; events stay runs of parent-linked hashes.
                self._publish(run, parent)
                run = []
            seq.num_hashed_blocks += 1
        self._publish(run, parent)

    def _publish(self, run: list[int], parent: int | None) -> None:
        if run and self.events is not None:
            self.events.record("stored", block_hashes=run, parent_block_hash=parent, block_size=self.block_size)

    def reset_prefix_cache(self) -> None:
        for b in list(self.free):
            self.hashes[b] = None
        self.hash_to_block = {h: b for h, b in self.hash_to_block.items() if self.ref_counts[b] > 0}
        if self.events is not None:
            self.events.record("cleared")
