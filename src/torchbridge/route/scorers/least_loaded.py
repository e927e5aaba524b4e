"""The `least-loaded` picker."""

from __future__ import annotations

import numpy as np

from .base import PickContext, Picker, argmax_random_tie


class LeastLoadedPicker(Picker):
    """Fewest requests on the replica (router in-flight or scraped, whichever is larger)."""

    name = "least-loaded"

    def __init__(self, path: str) -> None:
        pass

    def pick(self, ctx: PickContext, mask: np.ndarray, scores: np.ndarray) -> int:
        return argmax_random_tie(-ctx.pool.load(), mask, ctx.rng)
