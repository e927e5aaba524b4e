"""Each filter, scorer and picker on a hand-built load table, against hand-computed answers."""

from __future__ import annotations

import random

import numpy as np
import pytest

from torchbridge.route.config import build_profile, parse_config
from torchbridge.route.index import BlockIndex, block_hashes
from torchbridge.route.picker import EndpointPicker, NoReplicaError
from torchbridge.route.scorers import (
    InflightTokensScorer,
    KVHeadroomFilter,
    KVUtilizationScorer,
    LeastLoadedPicker,
    LoadScorer,
    LowQueueFilter,
    MaxScorePicker,
    PickContext,
    PrefixCacheScorer,
    QueueDepthScorer,
    RandomPicker,
    RequestCtx,
    RoundRobinPicker,
    RunningRequestsScorer,
    SessionAffinityScorer,
    StickyUntilSaturatedPicker,
)
from torchbridge.route.state import PoolState

TOKENS = list(range(160))  # 10 blocks of 16
HASHES = block_hashes(TOKENS, 16)


def make_ctx(n: int = 4, session: str | None = None, **cols: list[float]) -> PickContext:
    pool = PoolState(capacity=n, default_prefill_tps=1000.0)
    for i in range(n):
        pool.add(f"r{i}")
    for k, v in cols.items():
        getattr(pool, k)[:n] = v
    return PickContext(RequestCtx(HASHES, len(TOKENS), 16, session), pool, BlockIndex(), BlockIndex(), {},
                       random.Random(0))


def mask(n: int = 4) -> np.ndarray:
    return np.ones(n, dtype=bool)


def test_low_queue_filter_and_fallback() -> None:
    ctx = make_ctx(queue=[0, 5, 20, 3])
    assert LowQueueFilter("f", max_queue=4).apply(ctx, mask()).tolist() == [True, False, False, True]
    assert LowQueueFilter("f", max_queue=-1).apply(ctx, mask()).all()  # nobody passes: keep all


def test_kv_headroom_filter() -> None:
    ctx = make_ctx(kv_usage=[0.5, 0.99, 0.9, 0.2])
    assert KVHeadroomFilter("f", max_usage=0.9).apply(ctx, mask()).tolist() == [True, False, True, True]


def test_prefix_scorer_uses_approx_and_precise() -> None:
    ctx = make_ctx()
    ctx.approx.insert(1, HASHES[:5])
    ctx.precise.insert(2, HASHES[:8])
    ctx.precise.insert(3, HASHES)  # r3 does not publish events: ignored
    ctx.pool.precise[2] = True
    assert PrefixCacheScorer("s").score(ctx, mask()).tolist() == [0, 0.5, 0.8, 0]
    assert PrefixCacheScorer("s", index="approx").score(ctx, mask()).tolist() == [0, 0.5, 0, 0]
    assert PrefixCacheScorer("s", index="precise").score(ctx, mask()).tolist() == [0, 0, 0.8, 0]


@pytest.mark.parametrize("cls,col", [(QueueDepthScorer, "queue"), (RunningRequestsScorer, "running"),
                                     (InflightTokensScorer, "pending_tokens")])
def test_load_scorers_min_max(cls: type, col: str) -> None:
    ctx = make_ctx(**{col: [0, 10, 5, 10]})
    assert cls("s").score(ctx, mask()).tolist() == [1.0, 0.0, 0.5, 0.0]
    flat = make_ctx(**{col: [3, 3, 3, 3]})
    assert cls("s").score(flat, mask()).tolist() == [1.0] * 4


def test_load_scorer_takes_larger_of_router_and_scrape() -> None:
    ctx = make_ctx(inflight=[4, 0, 0, 1], queue=[0, 1, 0, 0], running=[0, 1, 0, 0])
    # loads: 4, 2, 0, 1
    assert LoadScorer("s").score(ctx, mask()).tolist() == [0.0, 0.5, 1.0, 0.75]


def test_kv_utilization_scorer() -> None:
    ctx = make_ctx(kv_usage=[0.0, 0.25, 1.0, 0.5])
    assert KVUtilizationScorer("s").score(ctx, mask()).tolist() == [1.0, 0.75, 0.0, 0.5]


def test_session_affinity() -> None:
    ctx = make_ctx(session="abc")
    ctx.sessions["abc"] = "r2"
    assert SessionAffinityScorer("s").score(ctx, mask()).tolist() == [0, 0, 1, 0]
    assert SessionAffinityScorer("s").score(make_ctx(session="zzz"), mask()).tolist() == [0, 0, 0, 0]


def test_max_score_random_and_round_robin_pickers() -> None:
    ctx = make_ctx()
    m = np.array([True, True, False, True])
    assert MaxScorePicker("p").pick(ctx, m, np.array([0.1, 0.9, 5.0, 0.3])) == 1  # masked-out 5.0 ignored
    rr = RoundRobinPicker("p")
    assert [rr.pick(ctx, m, np.zeros(4)) for _ in range(5)] == [0, 1, 3, 0, 1]
    picks = {RandomPicker("p").pick(ctx, m, np.zeros(4)) for _ in range(200)}
    assert picks == {0, 1, 3}
    ties = {MaxScorePicker("p").pick(ctx, m, np.zeros(4)) for _ in range(200)}
    assert ties == {0, 1, 3}  # ties are spread, not always the first


def test_least_loaded_picker() -> None:
    ctx = make_ctx(inflight=[3, 1, 0, 2], queue=[0, 0, 4, 0])
    assert LeastLoadedPicker("p").pick(ctx, mask(), np.zeros(4)) == 1


def test_sticky_until_saturated() -> None:
    # r1 holds 9/10 blocks. Prompt 160 tokens at 1000 tok/s: uncached on r1 = 16 tokens.
    p = StickyUntilSaturatedPicker("p", hit_threshold=0.8, max_extra_wait_s=0.5)
    ctx = make_ctx(pending_tokens=[0, 0, 0, 0])
    ctx.approx.insert(1, HASHES[:9])
    assert p.pick(ctx, mask(), np.zeros(4)) == 1
    # r1 has 600 queued tokens: wait 0.616 s vs 0.16 s elsewhere -> 0.456 s extra, within bound.
    ctx = make_ctx(pending_tokens=[0, 600, 0, 0])
    ctx.approx.insert(1, HASHES[:9])
    assert p.pick(ctx, mask(), np.zeros(4)) == 1
    # 700 queued: 0.716 - 0.16 = 0.556 s > 0.5 s bound -> the least-wait alternative (r3 is idle).
    ctx = make_ctx(pending_tokens=[50, 700, 80, 0])
    ctx.approx.insert(1, HASHES[:9])
    assert p.pick(ctx, mask(), np.zeros(4)) == 3
    # A hit below threshold (7/10) does not stick: the weighted scores decide.
    ctx = make_ctx()
    ctx.approx.insert(1, HASHES[:7])
    assert p.pick(ctx, mask(), np.array([0.0, 0.0, 1.0, 0.0])) == 2


def _picker(n: int = 3, **router: object) -> EndpointPicker:
    p = EndpointPicker(parse_config({"router": router} if router else {}), seed=1)
    for i in range(n):
        p.add_replica(f"r{i}", kv_blocks=64)
    return p


def test_profile_pipeline_prefix_affinity_and_accounting() -> None:
    p = _picker()
    req = p.request(TOKENS)
    d1 = p.pick(req, "prefix-aware")
    p.on_dispatch(d1)
    slot = p.pool.slots[d1.replica]
    assert p.pool.inflight[slot] == 1 and p.pool.pending_tokens[slot] == 160
    p.on_first_token(d1)
    assert p.pool.pending_tokens[slot] == 0
    p.on_finish(d1)
    assert p.pool.inflight[slot] == 0
    d2 = p.pick(p.request(TOKENS + [5] * 40), "prefix-aware")
    assert d2.replica == d1.replica and d2.hit_blocks == 10 and d2.uncached_tokens == 40


def test_failed_dispatch_is_forgotten_and_exclude_works() -> None:
    p = _picker(2)
    d = p.pick(p.request(TOKENS), "prefix-aware")
    p.on_dispatch(d)
    p.on_finish(d, ok=False)
    assert p.approx.match(HASHES) == {} and p.hit_ratio() == 0.0  # keyed by slot
    other = p.pick(p.request(TOKENS), "round-robin", exclude=[d.replica])
    assert other.replica != d.replica
    with pytest.raises(NoReplicaError):
        p.pick(p.request(TOKENS), "round-robin", exclude=["r0", "r1"])


def test_unhealthy_replicas_are_never_picked() -> None:
    p = _picker(3)
    p.pool.healthy[p.pool.slots["r1"]] = False
    seen = {p.pick(p.request(TOKENS), prof).replica for prof in p.profiles for _ in range(20)}
    assert "r1" not in seen


def test_kv_blocks_size_the_approx_lru() -> None:
    p = _picker(1)
    p.set_kv_blocks("r0", 100, block_size=32)  # 100 engine blocks of 32 tokens = 200 router blocks of 16
    assert p.approx.capacity(p.pool.slots["r0"]) == 200


def test_remove_replica_forgets_sessions() -> None:
    p = _picker(2)
    d = p.pick(p.request(TOKENS, "s"), "sticky")
    p.on_dispatch(d, "s")
    p.remove_replica(d.replica)
    assert "s" not in p.sessions and len(p.pool) == 1


def test_built_profile_is_independent_instance() -> None:
    a = build_profile("x", {"picker": "round-robin"})
    b = build_profile("x", {"picker": "round-robin"})
    assert a.picker is not b.picker
