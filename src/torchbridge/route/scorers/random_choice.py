"""The `random` picker."""

from __future__ import annotations

import numpy as np

from .base import PickContext, Picker


class RandomPicker(Picker):
    name = "random"

    def __init__(self, path: str) -> None:
        pass

    def pick(self, ctx: PickContext, mask: np.ndarray, scores: np.ndarray) -> int:
        idx = np.flatnonzero(mask)
        return int(idx[ctx.rng.randrange(len(idx))])
