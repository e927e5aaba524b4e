"""The endpoint picker: filters -> weighted scorers -> picker, plus the bookkeeping that feeds
the approximate prefix index and the in-flight columns. The proxy and the simulator both drive
this class, so simulated results exercise the production decision code.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .config import Profile, RouterConfig, build_profile
from .index import BlockIndex, block_hashes
from .load_table import PoolState
from .scorers import PickContext, RequestCtx
from .sessions import SessionTable


class NoReplicaError(RuntimeError):
    """No healthy replica is left to try."""


@dataclass
class Decision:
    replica: str
    profile: str
    hit_blocks: int          # prompt blocks the chosen replica is believed to hold
    n_blocks: int
    uncached_tokens: int     # prompt tokens it will have to prefill (the router's estimate)
    latency_s: float         # time spent deciding
    hashes: list[int]
    first_token_seen: bool = False


class EndpointPicker:
    def __init__(self, cfg: RouterConfig, seed: int | None = None, capacity: int = 8) -> None:
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.pool = PoolState(capacity=capacity, default_prefill_tps=cfg.default_prefill_tps)
        self.approx = BlockIndex()
        self.precise = BlockIndex()
        self.sessions = SessionTable(cfg.max_sessions)
        # Engine KV events only match our keys when we tokenize exactly as the engine does.
        self.tokenizer_exact = False
        self.rng = random.Random(seed)
        self.profiles: dict[str, Profile] = {n: build_profile(n, s) for n, s in cfg.profiles.items()}
        # Totals for the prefix hit ratio (blocks believed cached / blocks routed).
        self.blocks_routed = 0
        self.blocks_hit = 0

    # -- membership --------------------------------------------------------------------------
    # The indexes are keyed by pool slot, not name, so a decision can fill score arrays directly.
    def add_replica(self, name: str, kv_blocks: int | None = None, healthy: bool = True) -> None:
        slot = self.pool.add(name, healthy=healthy)
        self.approx.add_replica(slot)
        self.precise.add_replica(slot)
        self.set_kv_blocks(name, kv_blocks or self.cfg.default_kv_blocks)

    def remove_replica(self, name: str) -> None:
        slot = self.pool.slots[name]
        self.approx.remove_replica(slot)
        self.precise.remove_replica(slot)
        self.pool.remove(name)
        self.sessions.forget_replica(name)

    def set_kv_blocks(self, name: str, kv_blocks: int, block_size: int | None = None) -> None:
        """Size the approximate LRU to the replica's KV capacity, converted to router blocks."""
        slot = self.pool.slots[name]
        self.pool.kv_blocks[slot] = kv_blocks
        if block_size:
            self.pool.block_size[slot] = block_size
        engine_bs = block_size or self.block_size
        self.approx.set_capacity(slot, max(1, int(kv_blocks * engine_bs / self.block_size)))

    # -- decisions ---------------------------------------------------------------------------
    def request(self, tokens: Sequence[int], session: str | None = None) -> RequestCtx:
        return RequestCtx(block_hashes(tokens, self.block_size), len(tokens), self.block_size, session)

    def request_from_hashes(self, hashes: list[int], n_tokens: int, session: str | None = None) -> RequestCtx:
        return RequestCtx(hashes, n_tokens, self.block_size, session)

    def pick(self, req: RequestCtx, profile: str | None = None, exclude: Iterable[str] = ()) -> Decision:
        t0 = time.perf_counter()
        pname = profile or self.cfg.default_profile
        prof = self.profiles.get(pname)
        if prof is None:
            raise KeyError(f"unknown routing profile {pname!r}; known: {sorted(self.profiles)}")
        pool = self.pool
        mask = pool.eligible()
        for name in exclude:
            slot = pool.slots.get(name)
            if slot is not None:
                mask[slot] = False
        if not mask.any():
            raise NoReplicaError("no healthy replica available")
        ctx = PickContext(req, pool, self.approx, self.precise, self.sessions, self.rng)
        for f in prof.filters:
            mask = f.apply(ctx, mask)
        scores = np.zeros(len(pool.names))
        for scorer, w in prof.scorers:
            if w:
                scores += w * scorer.score(ctx, mask)
        slot = prof.picker.pick(ctx, mask, scores)
        hit = int(ctx.hit_blocks()[slot])
        name = pool.names[slot]
        assert name is not None
        uncached = max(0, req.n_tokens - hit * self.block_size)
        return Decision(name, pname, hit, len(req.hashes), uncached, time.perf_counter() - t0, req.hashes)

    # -- accounting --------------------------------------------------------------------------
    def on_dispatch(self, d: Decision, session: str | None = None) -> None:
        slot = self.pool.slots.get(d.replica)
        if slot is None:
            return
        self.pool.inflight[slot] += 1
        self.pool.pending_tokens[slot] += d.uncached_tokens
        self.approx.insert(slot, d.hashes)
        if session is not None:
            self.sessions[session] = d.replica
        self.blocks_routed += d.n_blocks
        self.blocks_hit += d.hit_blocks

    def on_first_token(self, d: Decision) -> None:
        if d.first_token_seen:
            return
        d.first_token_seen = True
        slot = self.pool.slots.get(d.replica)
        if slot is not None:
            self.pool.pending_tokens[slot] = max(0.0, self.pool.pending_tokens[slot] - d.uncached_tokens)

    def on_finish(self, d: Decision, ok: bool = True) -> None:
        self.on_first_token(d)
        slot = self.pool.slots.get(d.replica)
        if slot is not None:
            self.pool.inflight[slot] = max(0.0, self.pool.inflight[slot] - 1)
        if not ok:
            # The replica never served it, so it caches nothing and the hit never happened.
            if slot is not None:
                self.approx.remove(slot, d.hashes[d.hit_blocks:])
            self.blocks_routed -= d.n_blocks
            self.blocks_hit -= d.hit_blocks

    def hit_ratio(self) -> float:
        return self.blocks_hit / self.blocks_routed if self.blocks_routed else 0.0
