"""The `kv-cache-utilization` scorer."""

from __future__ import annotations

import numpy as np

from .base import PickContext, Scorer


class KVUtilizationScorer(Scorer):
    name = "kv-cache-utilization"

    def __init__(self, path: str) -> None:
        pass

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        return np.clip(1.0 - ctx.pool.kv_usage, 0.0, 1.0)
