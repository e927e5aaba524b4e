"""The `session-affinity` scorer."""

from __future__ import annotations

import numpy as np

from .base import PickContext, Scorer


class SessionAffinityScorer(Scorer):
    """1 for the replica this session's previous request went to."""

    name = "session-affinity"

    def __init__(self, path: str) -> None:
        pass

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        out = np.zeros(len(ctx.pool.names))
        sess = ctx.req.session
        if sess is not None:
            slot = ctx.pool.slots.get(ctx.sessions.get(sess, ""))
            if slot is not None:
                out[slot] = 1.0
        return out
