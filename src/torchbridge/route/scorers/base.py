"""What every routing plugin sees and is: the request and pick contexts, the Filter / Scorer / Picker
bases, config errors, and the two normalisations plugins share.

Every plugin works on whole numpy columns of the load table, so a decision over 1,000 replicas costs a
few vector ops. Filters narrow a boolean mask; scorers return a score in [0, 1] per slot (higher is
better) and are combined as a weighted sum; the picker chooses one slot from the survivors.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..index import BlockIndex
from ..load_table import PoolState


@dataclass
class RequestCtx:
    hashes: list[int]            # chained block hashes of the prompt
    n_tokens: int                # prompt length in router tokens
    block_size: int
    session: str | None = None


@dataclass
class PickContext:
    req: RequestCtx
    pool: PoolState
    approx: BlockIndex
    precise: BlockIndex | None
    sessions: dict[str, str]
    rng: random.Random
    _hits: dict[str, np.ndarray] = field(default_factory=dict)

    def hit_blocks(self, mode: str = "auto") -> np.ndarray:
        """Leading prompt blocks cached on each slot, per the chosen index.

        approx: the router's own decisions (instant, but guesses evictions); precise: engine KV
        events (exact, but lags a request's prefill by a poll interval); auto: the larger of the
        two, which is sound because eviction events are also applied to the approximate index.
        """
        got = self._hits.get(mode)
        if got is not None:
            return got
        pool = self.pool
        hits = np.zeros(len(pool.names), dtype=np.float64)
        if mode in ("approx", "auto"):
            for group, n in self.approx.match_groups(self.req.hashes):
                hits[np.fromiter(group, dtype=np.int64, count=len(group))] = n
        if mode in ("precise", "auto") and self.precise is not None and pool.precise.any():
            exact = np.zeros_like(hits)
            for group, n in self.precise.match_groups(self.req.hashes):
                exact[np.fromiter(group, dtype=np.int64, count=len(group))] = n
            hits = np.where(pool.precise, np.maximum(hits, exact), hits)
        self._hits[mode] = hits
        return hits

    def hit_fraction(self, mode: str = "auto") -> np.ndarray:
        n_blocks = len(self.req.hashes)
        if n_blocks == 0:
            return np.zeros(len(self.pool.names))
        return self.hit_blocks(mode) / n_blocks

    def uncached_tokens(self, mode: str = "auto") -> np.ndarray:
        cached = self.hit_blocks(mode) * self.req.block_size
        return np.maximum(self.req.n_tokens - cached, 0.0)

    def est_prefill_wait(self, mode: str = "auto", queue_wait_s: float = 0.0) -> np.ndarray:
        """Seconds until this request's first token on each slot: the router's queued uncached
        prompt tokens there plus this request's own uncached tokens, at the slot's prefill rate,
        plus `queue_wait_s` per request the engine reports waiting (those wait for batch slots or
        KV memory, not for prefill compute, so token counts alone miss them)."""
        pool = self.pool
        prefill = (pool.pending_tokens + self.uncached_tokens(mode)) / np.maximum(pool.prefill_tps, 1e-9)
        return prefill + queue_wait_s * pool.queue if queue_wait_s else prefill


class ConfigError(ValueError):
    """A bad router config; the message starts with the path of the offending key."""


def check_params(path: str, params: dict[str, Any], allowed: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
    unknown = set(params) - set(allowed)
    if unknown:
        raise ConfigError(f"{path}: unknown parameter(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
    for k, v in params.items():
        t = allowed[k]
        if isinstance(v, bool) and t in (int, float, (int, float)):
            raise ConfigError(f"{path}.{k}: expected a number, got {v!r}")
        if not isinstance(v, t):
            raise ConfigError(f"{path}.{k}: expected {getattr(t, '__name__', t)}, got {v!r}")
    return params


def min_max_inverse(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """1 for the smallest value among masked slots, 0 for the largest, linear between (the usual
    llm-d normalisation, so a load scorer is insensitive to the pool's absolute load)."""
    out = np.zeros_like(values, dtype=np.float64)
    if not mask.any():
        return out
    v = values[mask]
    lo, hi = float(v.min()), float(v.max())
    out[mask] = 1.0 if hi == lo else (hi - v) / (hi - lo)
    return out


class Filter:
    name = "filter"

    def apply(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class Scorer:
    name = "scorer"

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        raise NotImplementedError


def argmax_random_tie(values: np.ndarray, mask: np.ndarray, rng: random.Random) -> int:
    idx = np.flatnonzero(mask)
    v = values[idx]
    best = np.flatnonzero(v >= v.max() - 1e-12)
    return int(idx[best[rng.randrange(len(best))]])


class Picker:
    name = "picker"

    def pick(self, ctx: PickContext, mask: np.ndarray, scores: np.ndarray) -> int:
        raise NotImplementedError
