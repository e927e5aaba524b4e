"""The `running-requests` scorer."""

from __future__ import annotations

import numpy as np

from .base import PickContext, Scorer, min_max_inverse


class RunningRequestsScorer(Scorer):
    name = "running-requests"

    def __init__(self, path: str) -> None:
        pass

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        return min_max_inverse(ctx.pool.running, mask)
