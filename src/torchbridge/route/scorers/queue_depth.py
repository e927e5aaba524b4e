"""The `queue-depth` scorer."""

from __future__ import annotations

import numpy as np

from .base import PickContext, Scorer, min_max_inverse


class QueueDepthScorer(Scorer):
    name = "queue-depth"

    def __init__(self, path: str) -> None:
        pass

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        return min_max_inverse(ctx.pool.queue, mask)
