"""The `prefix-cache` scorer."""

from __future__ import annotations

import numpy as np

from .base import ConfigError, PickContext, Scorer


class PrefixCacheScorer(Scorer):
    """Fraction of the prompt's blocks already cached on the replica."""

    name = "prefix-cache"

    def __init__(self, path: str, index: str = "auto") -> None:
        if index not in ("auto", "approx", "precise"):
            raise ConfigError(f"{path}.index: must be auto, approx or precise, got {index!r}")
        self.index = index

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        return ctx.hit_fraction(self.index)
