"""The pool's load table: one slot per replica, numpy columns so scorers stay vectorised.

The proxy fills it from health checks, /metrics scrapes and its own in-flight accounting; the
simulator fills it from simulated replicas. Scorers and pickers read only this table and the
prefix indexes, which is what lets the simulator run the proxy's exact decision code.
"""

from __future__ import annotations

import numpy as np

_FLOAT_COLS = ("queue", "running", "kv_usage", "inflight", "pending_tokens", "prefill_tps")
_INT_COLS = ("kv_blocks", "block_size")
_BOOL_COLS = ("active", "healthy", "precise")


class PoolState:
    """Columns (all indexed by slot):

    queue, running, kv_usage  -- last scraped engine numbers (kv_usage in [0, 1])
    inflight                  -- requests the router has sent and not yet seen finish
    pending_tokens            -- uncached prompt tokens of those requests still awaiting their
                                 first token: the router's own estimate of prefill work queued
    prefill_tps               -- prefill rate estimate (tokens/s) used for wait estimates
    kv_blocks, block_size     -- from vllm:cache_config_info (0 when unknown)
    active, healthy, precise  -- slot in use; passes health checks; publishes KV events
    """

    queue: np.ndarray
    running: np.ndarray
    kv_usage: np.ndarray
    inflight: np.ndarray
    pending_tokens: np.ndarray
    prefill_tps: np.ndarray
    kv_blocks: np.ndarray
    block_size: np.ndarray
    active: np.ndarray
    healthy: np.ndarray
    precise: np.ndarray

    def __init__(self, capacity: int = 8, default_prefill_tps: float = 2000.0) -> None:
        self.default_prefill_tps = default_prefill_tps
        self.names: list[str | None] = []
        self.slots: dict[str, int] = {}
        self._alloc(max(1, capacity))

    def _alloc(self, n: int) -> None:
        old = len(self.names)
        for col in _FLOAT_COLS:
            self._grow(col, n, np.float64)
        for col in _INT_COLS:
            self._grow(col, n, np.int64)
        for col in _BOOL_COLS:
            self._grow(col, n, np.bool_)
        self.names.extend([None] * (n - old))

    def _grow(self, col: str, n: int, dtype: type) -> None:
        new = np.zeros(n, dtype=dtype)
        cur = getattr(self, col, None)
        if cur is not None:
            new[: len(cur)] = cur
        setattr(self, col, new)

    def __len__(self) -> int:
        return len(self.slots)

    def add(self, name: str, healthy: bool = True) -> int:
        if name in self.slots:
            raise ValueError(f"replica {name!r} already in the pool")
        try:
            slot = self.names.index(None)
        except ValueError:
            slot = len(self.names)
            self._alloc(2 * len(self.names))
        self.names[slot] = name
        self.slots[name] = slot
        for col in _FLOAT_COLS + _INT_COLS + _BOOL_COLS:
            getattr(self, col)[slot] = 0
        self.prefill_tps[slot] = self.default_prefill_tps
        self.active[slot] = True
        self.healthy[slot] = healthy
        return slot

    def remove(self, name: str) -> None:
        slot = self.slots.pop(name)
        self.names[slot] = None
        self.active[slot] = False
        self.healthy[slot] = False

    def eligible(self) -> np.ndarray:
        return self.active & self.healthy

    def load(self) -> np.ndarray:
        """Requests on each replica: the router's own count is current but misses other clients;
        the scrape sees everyone but lags; the larger of the two is the safer estimate."""
        return np.maximum(self.inflight, self.queue + self.running)
