"""The `inflight-tokens` scorer."""

from __future__ import annotations

import numpy as np

from .base import PickContext, Scorer, min_max_inverse


class InflightTokensScorer(Scorer):
    """The router's own queued uncached prompt tokens per replica: current at decision time,
    unlike scraped metrics, so it breaks herding when many requests arrive between scrapes."""

    name = "inflight-tokens"

    def __init__(self, path: str) -> None:
        pass

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        return min_max_inverse(ctx.pool.pending_tokens, mask)
