"""The `load` scorer."""

from __future__ import annotations

import numpy as np

from .base import PickContext, Scorer, min_max_inverse


class LoadScorer(Scorer):
    """Requests on the replica (see PoolState.load)."""

    name = "load"

    def __init__(self, path: str) -> None:
        pass

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        return min_max_inverse(ctx.pool.load(), mask)
