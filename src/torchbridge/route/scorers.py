"""Filters, scorers and pickers: the plugins a profile is assembled from.

Every plugin sees a `PickContext` (the request, the pool's load table and the prefix indexes)
and works on whole numpy columns, so a decision over 1,000 replicas costs a few vector ops.
Filters narrow a boolean mask; scorers return a score in [0, 1] per slot (higher is better) and
are combined as a weighted sum; the picker chooses one slot from the survivors.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .index import BlockIndex
from .state import PoolState


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


def _params(path: str, params: dict[str, Any], allowed: dict[str, type | tuple[type, ...]]) -> dict[str, Any]:
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


def _min_max_inverse(values: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """1 for the smallest value among masked slots, 0 for the largest, linear between (the usual
    llm-d normalisation, so a load scorer is insensitive to the pool's absolute load)."""
    out = np.zeros_like(values, dtype=np.float64)
    if not mask.any():
        return out
    v = values[mask]
    lo, hi = float(v.min()), float(v.max())
    out[mask] = 1.0 if hi == lo else (hi - v) / (hi - lo)
    return out


# ---------------------------------------------------------------------------------------------
# Filters: (ctx, mask) -> mask


class Filter:
    name = "filter"

    def apply(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class LowQueueFilter(Filter):
    """Drop replicas whose scraped queue exceeds `max_queue`; if that drops all, keep all (a
    filter must not turn load into an outage)."""

    name = "low-queue"

    def __init__(self, path: str, max_queue: float = 128) -> None:
        self.max_queue = float(max_queue)

    def apply(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        keep = mask & (ctx.pool.queue <= self.max_queue)
        return keep if keep.any() else mask


class KVHeadroomFilter(Filter):
    """Drop replicas whose KV utilisation is above `max_usage` (same fall-back as low-queue)."""

    name = "kv-headroom"

    def __init__(self, path: str, max_usage: float = 0.95) -> None:
        if not 0 <= max_usage <= 1:
            raise ConfigError(f"{path}.max_usage: must be in [0, 1], got {max_usage}")
        self.max_usage = float(max_usage)

    def apply(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        keep = mask & (ctx.pool.kv_usage <= self.max_usage)
        return keep if keep.any() else mask


# ---------------------------------------------------------------------------------------------
# Scorers: (ctx, mask) -> scores in [0, 1]


class Scorer:
    name = "scorer"

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class PrefixCacheScorer(Scorer):
    """Fraction of the prompt's blocks already cached on the replica."""

    name = "prefix-cache"

    def __init__(self, path: str, index: str = "auto") -> None:
        if index not in ("auto", "approx", "precise"):
            raise ConfigError(f"{path}.index: must be auto, approx or precise, got {index!r}")
        self.index = index

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        return ctx.hit_fraction(self.index)


class QueueDepthScorer(Scorer):
    name = "queue-depth"

    def __init__(self, path: str) -> None:
        pass

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        return _min_max_inverse(ctx.pool.queue, mask)


class RunningRequestsScorer(Scorer):
    name = "running-requests"

    def __init__(self, path: str) -> None:
        pass

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        return _min_max_inverse(ctx.pool.running, mask)


class KVUtilizationScorer(Scorer):
    name = "kv-cache-utilization"

    def __init__(self, path: str) -> None:
        pass

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        return np.clip(1.0 - ctx.pool.kv_usage, 0.0, 1.0)


class InflightTokensScorer(Scorer):
    """The router's own queued uncached prompt tokens per replica: current at decision time,
    unlike scraped metrics, so it breaks herding when many requests arrive between scrapes."""

    name = "inflight-tokens"

    def __init__(self, path: str) -> None:
        pass

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        return _min_max_inverse(ctx.pool.pending_tokens, mask)


class LoadScorer(Scorer):
    """Requests on the replica (see PoolState.load)."""

    name = "load"

    def __init__(self, path: str) -> None:
        pass

    def score(self, ctx: PickContext, mask: np.ndarray) -> np.ndarray:
        return _min_max_inverse(ctx.pool.load(), mask)


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


# ---------------------------------------------------------------------------------------------
# Pickers: (ctx, mask, combined scores) -> slot


def _argmax_random_tie(values: np.ndarray, mask: np.ndarray, rng: random.Random) -> int:
    idx = np.flatnonzero(mask)
    v = values[idx]
    best = np.flatnonzero(v >= v.max() - 1e-12)
    return int(idx[best[rng.randrange(len(best))]])


class Picker:
    name = "picker"

    def pick(self, ctx: PickContext, mask: np.ndarray, scores: np.ndarray) -> int:
        raise NotImplementedError


class MaxScorePicker(Picker):
    """Highest weighted score; ties broken at random so equal replicas share load."""

    name = "max-score"

    def __init__(self, path: str) -> None:
        pass

    def pick(self, ctx: PickContext, mask: np.ndarray, scores: np.ndarray) -> int:
        return _argmax_random_tie(scores, mask, ctx.rng)


class RandomPicker(Picker):
    name = "random"

    def __init__(self, path: str) -> None:
        pass

    def pick(self, ctx: PickContext, mask: np.ndarray, scores: np.ndarray) -> int:
        idx = np.flatnonzero(mask)
        return int(idx[ctx.rng.randrange(len(idx))])


class RoundRobinPicker(Picker):
    name = "round-robin"

    def __init__(self, path: str) -> None:
        self._last = -1

    def pick(self, ctx: PickContext, mask: np.ndarray, scores: np.ndarray) -> int:
        idx = np.flatnonzero(mask)
        after = idx[idx > self._last]
        self._last = int(after[0] if len(after) else idx[0])
        return self._last


class LeastLoadedPicker(Picker):
    """Fewest requests on the replica (router in-flight or scraped, whichever is larger)."""

    name = "least-loaded"

    def __init__(self, path: str) -> None:
        pass

    def pick(self, ctx: PickContext, mask: np.ndarray, scores: np.ndarray) -> int:
        return _argmax_random_tie(-ctx.pool.load(), mask, ctx.rng)


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
            return _argmax_random_tie(scores, mask, ctx.rng)
        wait = ctx.est_prefill_wait(self.index, self.queue_wait_s)
        # Among sufficient hits prefer the longest, then the shortest wait.
        home = _argmax_random_tie(frac - 1e-6 * wait / (1.0 + wait.max()), sticky, ctx.rng)
        others = mask.copy()
        others[home] = False
        if not others.any():
            return home
        alt = _argmax_random_tie(-wait, others, ctx.rng)
        if wait[home] - wait[alt] <= self.max_extra_wait_s:
            return home
        return alt


FILTERS: dict[str, Callable[..., Filter]] = {c.name: c for c in (LowQueueFilter, KVHeadroomFilter)}
SCORERS: dict[str, Callable[..., Scorer]] = {c.name: c for c in (
    PrefixCacheScorer, QueueDepthScorer, RunningRequestsScorer, KVUtilizationScorer,
    InflightTokensScorer, LoadScorer, SessionAffinityScorer)}
PICKERS: dict[str, Callable[..., Picker]] = {c.name: c for c in (
    MaxScorePicker, RandomPicker, RoundRobinPicker, LeastLoadedPicker, StickyUntilSaturatedPicker)}


def build_plugin(kind: str, registry: dict[str, Callable[..., Any]], path: str, spec: Any,
                 extra_keys: tuple[str, ...] = ()) -> Any:
    """Instantiate `{type: name, **params}` from `registry`, with path-prefixed errors."""
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: expected a mapping with 'type', got {spec!r}")
    typ = spec.get("type")
    if typ not in registry:
        raise ConfigError(f"{path}.type: unknown {kind} {typ!r}; known: {sorted(registry)}")
    params = {k: v for k, v in spec.items() if k != "type" and k not in extra_keys}
    cls = registry[typ]
    import inspect

    sig = inspect.signature(cls.__init__)
    allowed = {}
    for pname, p in list(sig.parameters.items())[2:]:  # skip self, path
        default = p.default
        allowed[pname] = (int, float) if isinstance(default, (int, float)) and not isinstance(default, bool) \
            else type(default)
    _params(path, params, allowed)
    return cls(path, **params)
