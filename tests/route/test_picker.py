"""The endpoint picker: profiles assembled from plugins, accounting, membership, sessions."""

from __future__ import annotations

import pytest
from route_support import HASHES, TOKENS

from torchbridge.route.config import build_profile, parse_config
from torchbridge.route.picker import EndpointPicker, NoReplicaError


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


def test_session_table_is_bounded_lru() -> None:
    p = _picker(2, max_sessions=3)
    for i in range(5):
        d = p.pick(p.request(TOKENS, f"s{i}"), "sticky")
        p.on_dispatch(d, f"s{i}")
    assert list(p.sessions) == ["s2", "s3", "s4"]  # the two oldest forgotten
    p.on_dispatch(p.pick(p.request(TOKENS, "s2"), "sticky"), "s2")  # used again: most recent
    p.on_dispatch(p.pick(p.request(TOKENS, "s5"), "sticky"), "s5")
    assert list(p.sessions) == ["s4", "s2", "s5"]
