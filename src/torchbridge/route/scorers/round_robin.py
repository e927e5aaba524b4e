"""The `round-robin` picker."""

from __future__ import annotations

import numpy as np

from .base import PickContext, Picker


class RoundRobinPicker(Picker):
    name = "round-robin"

    def __init__(self, path: str) -> None:
        self._last = -1

    def pick(self, ctx: PickContext, mask: np.ndarray, scores: np.ndarray) -> int:
        idx = np.flatnonzero(mask)
        after = idx[idx > self._last]
        self._last = int(after[0] if len(after) else idx[0])
        return self._last
