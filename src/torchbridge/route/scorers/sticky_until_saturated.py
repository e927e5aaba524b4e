"""The `sticky-until-saturated` picker."""

from __future__ import annotations

import numpy as np

from .base import ConfigError, PickContext, Picker, argmax_random_tie


class StickyUntilSaturatedPicker(Picker):
    """Keep a cache hit unless it has become the bottleneck.

    If some replica holds at least `hit_threshold` of the prompt, go there unless its estimated
    prefill wait exceeds the best alternative's by more than `max_extra_wait_s`; then go to the
    alternative with the smallest wait. Without such a hit, fall back to the weighted scores.
    `queue_wait_s` converts each engine-reported waiting request into seconds of wait.
    """

    name = "sticky-until-saturated"

    def __init__(self, path: str, hit_threshold: float = 0.8, max_extra_wait_s: float = 0.5,
                 queue_wait_s: float = 0.25, index: str = "auto") -> None:
        if not 0 < hit_threshold <= 1:
            raise ConfigError(f"{path}.hit_threshold: must be in (0, 1], got {hit_threshold}")
        if max_extra_wait_s < 0:
            raise ConfigError(f"{path}.max_extra_wait_s: must be >= 0, got {max_extra_wait_s}")
        if queue_wait_s < 0:
            raise ConfigError(f"{path}.queue_wait_s: must be >= 0, got {queue_wait_s}")
        self.queue_wait_s = float(queue_wait_s)
        if index not in ("auto", "approx", "precise"):
            raise ConfigError(f"{path}.index: must be auto, approx or precise, got {index!r}")
        self.hit_threshold = float(hit_threshold)
        self.max_extra_wait_s = float(max_extra_wait_s)
        self.index = index

    def pick(self, ctx: PickContext, mask: np.ndarray, scores: np.ndarray) -> int:
        frac = ctx.hit_fraction(self.index)
        sticky = mask & (frac >= self.hit_threshold)
        if not sticky.any():
            return argmax_random_tie(scores, mask, ctx.rng)
        wait = ctx.est_prefill_wait(self.index, self.queue_wait_s)
        # Among sufficient hits prefer the longest, then the shortest wait.
        home = argmax_random_tie(frac - 1e-6 * wait / (1.0 + wait.max()), sticky, ctx.rng)
        others = mask.copy()
        others[home] = False
        if not others.any():
            return home
        alt = argmax_random_tie(-wait, others, ctx.rng)
        if wait[home] - wait[alt] <= self.max_extra_wait_s:
            return home
        return alt
