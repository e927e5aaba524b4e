"""The `kv-headroom` filter."""

from __future__ import annotations

import numpy as np

from .base import ConfigError, Filter, PickContext


class KVHeadroomFilter(Filter):
    """Drop replicas whose KV utilisation is above `max_usage` (same fall-back as low-queue)."""

    name = "kv-headroom"

    def __init__(self, path: str, max_usage: float = 0.95) -> None:
        if not 0 <= max_usage <= 1:
            raise ConfigError(f"{path}.max_usage: must be in [0, 1], got {max_usage}")
        self.max_usage = float(max_usage)

    def apply(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        keep = mask & (ctx.pool.kv_usage <= self.max_usage)
        return keep if keep.any() else mask
