"""The `low-queue` filter."""

from __future__ import annotations

import numpy as np

from .base import Filter, PickContext


class LowQueueFilter(Filter):
    """Drop replicas whose scraped queue exceeds `max_queue`; if that drops all, keep all (a
    filter must not turn load into an outage)."""

    name = "low-queue"

    def __init__(self, path: str, max_queue: float = 128) -> None:
        self.max_queue = float(max_queue)

    def apply(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        keep = mask & (ctx.pool.queue <= self.max_queue)
        return keep if keep.any() else mask
