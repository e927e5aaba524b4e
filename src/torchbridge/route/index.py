"""Prefix-cache indexes keyed by chained block hashes (torchbridge.block_hash).

Equal keys imply equal prefixes, which lets an index answer "how many leading blocks of this prompt
does replica r hold?" by walking the chain. The engine's block manager uses the same module, so with
the engine's tokenizer the router's keys are the engine's and its KV events apply to the precise
index as they are.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence

from torchbridge.block_hash import block_hashes

__all__ = ["BlockIndex", "block_hashes"]


class BlockIndex:
    """Which replica holds which block hash, with an optional per-replica LRU capacity.

    With a capacity it is the *approximate* index: the router records its own routing decisions
    and evicts least-recently-routed blocks once a replica's KV capacity is exceeded. Without one
    it is the *precise* index, fed by engine KV events that report evictions themselves.
    """

    def __init__(self) -> None:
        self._lru: dict[Hashable, OrderedDict[int, None]] = {}
        self._capacity: dict[Hashable, int | None] = {}
        self._owners: dict[int, set[Hashable]] = {}

    # -- membership --------------------------------------------------------------------------
    def add_replica(self, replica: Hashable, capacity: int | None = None) -> None:
        self._lru.setdefault(replica, OrderedDict())
        self.set_capacity(replica, capacity)

    def set_capacity(self, replica: Hashable, capacity: int | None) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self._capacity[replica] = capacity
        self._evict(replica)

    def remove_replica(self, replica: Hashable) -> None:
        self.clear(replica)
        self._lru.pop(replica, None)
        self._capacity.pop(replica, None)

    def replicas(self) -> list[Hashable]:
        return list(self._lru)

    def size(self, replica: Hashable) -> int:
        return len(self._lru.get(replica, ()))

    def capacity(self, replica: Hashable) -> int | None:
        return self._capacity.get(replica)

    # -- updates -----------------------------------------------------------------------------
    def insert(self, replica: Hashable, hashes: Iterable[int]) -> None:
        """Mark a chain of blocks as held. Unknown replicas are added uncapped.

        The chain is touched tail-first so its head ends most recently used: under LRU pressure a
        prefix then loses its tail before its head (as engines evict), and never keeps an
        unreachable tail behind a missing head.
        """
        lru = self._lru.get(replica)
        if lru is None:
            self.add_replica(replica)
            lru = self._lru[replica]
        for h in reversed(list(hashes)):
            if h in lru:
                lru.move_to_end(h)
            else:
                lru[h] = None
                self._owners.setdefault(h, set()).add(replica)
        self._evict(replica)

    def remove(self, replica: Hashable, hashes: Iterable[int]) -> None:
        lru = self._lru.get(replica)
        if lru is None:
            return
        for h in hashes:
            if lru.pop(h, 0) is None:
                self._drop_owner(h, replica)

    def clear(self, replica: Hashable) -> None:
        lru = self._lru.get(replica)
        if lru is None:
            return
        for h in lru:
            self._drop_owner(h, replica)
        lru.clear()

    # -- queries -----------------------------------------------------------------------------
    def contains(self, replica: Hashable, h: int) -> bool:
        return h in self._lru.get(replica, ())

    def match(self, hashes: Sequence[int]) -> dict[Hashable, int]:
        """Number of leading blocks of `hashes` each replica holds (replicas with 0 omitted)."""
        return {r: n for group, n in self.match_groups(hashes) for r in group}

    def match_groups(self, hashes: Sequence[int]) -> list[tuple[set[Hashable], int]]:
        """`match` as (replicas, matched blocks) groups, so callers can fill arrays in bulk.

        The walk keeps the set of replicas still matching and only touches it when a block's
        owner set is smaller (or the set is small), so its cost is the chain length plus the pool
        size, not their product; that keeps a decision cheap at 1,000 replicas with a system
        prompt cached everywhere. Skipping the large, non-shrinking sets is exact because
        chains are prefix-closed (a replica holding block i holds block i-1): `insert` touches
        parents after children, so LRU never evicts a parent first, and `remove` callers drop
        tails; an event-fed index inherits the engine's leaf-first eviction.
        """
        groups: list[tuple[set[Hashable], int]] = []
        if not hashes:
            return groups
        first = self._owners.get(hashes[0])
        if not first:
            return groups
        alive = set(first)
        n = len(hashes)
        for i in range(1, n):
            holders = self._owners.get(hashes[i])
            if not holders:
                groups.append((alive, i))
                return groups
            if len(holders) < len(alive) or len(alive) <= 64:
                nxt = alive & holders
                if len(nxt) != len(alive):
                    groups.append((alive - nxt, i))
                    if not nxt:
                        return groups
                    alive = nxt
        groups.append((alive, n))
        return groups

    # -- internals ---------------------------------------------------------------------------
    def _drop_owner(self, h: int, replica: Hashable) -> None:
        owners = self._owners.get(h)
        if owners is not None:
            owners.discard(replica)
            if not owners:
                del self._owners[h]

    def _evict(self, replica: Hashable) -> None:
        cap = self._capacity.get(replica)
        lru = self._lru.get(replica)
        if cap is None or lru is None:
            return
        while len(lru) > cap:
            h, _ = lru.popitem(last=False)
            self._drop_owner(h, replica)
