"""The `max-score` picker."""

from __future__ import annotations

import numpy as np

from .base import PickContext, Picker, argmax_random_tie


class MaxScorePicker(Picker):
    """Highest weighted score; ties broken at random so equal replicas share load."""

    name = "max-score"

    def __init__(self, path: str) -> None:
        pass

    def pick(self, ctx: PickContext, mask: np.ndarray, scores: np.ndarray) -> int:
        return argmax_random_tie(scores, mask, ctx.rng)
