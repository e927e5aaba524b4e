"""The simulator against hand-computed traces and queueing theory, and running the real picker."""

from __future__ import annotations

import math
import random

import pytest

from torchbridge.route.config import parse_config
from torchbridge.route.index import block_hashes
from torchbridge.route.picker import EndpointPicker
from torchbridge.route.simulator import (
    AgenticWorkload,
    ReplicaModel,
    SharedPrefixWorkload,
    SimRequest,
    Simulator,
    dedicated_route,
    run_agentic,
    run_shared_prefix,
    summarize,
)


def one_replica(**model: float) -> Simulator:
    m = ReplicaModel(**{"prefill_tps": 1000.0, "decode_base_s": 0.01, "decode_per_seq_s": 0.0, "max_batch": 1,
                        "kv_blocks": 100000, **model})
    return Simulator(EndpointPicker(parse_config({}), seed=0), {"r0": m}, "round-robin")


def req(rid: int, tokens: list[int], max_tokens: int, t: float = 0.0) -> SimRequest:
    return SimRequest(rid, block_hashes(tokens, 16), len(tokens), max_tokens, t)


def submit_at(sim: Simulator, r: SimRequest) -> None:
    sim.at(r.arrival, lambda: sim.submit(r))


def test_serial_prefills_hand_trace() -> None:
    sim = one_replica()
    rs = [req(i, list(range(i * 1000, i * 1000 + 100)), 1) for i in range(3)]
    for r in rs:
        submit_at(sim, r)
    sim.run()
    # 100 tokens at 1000 tok/s, one at a time: first tokens at 0.1, 0.2, 0.3.
    assert [r.ttft for r in rs] == pytest.approx([0.1, 0.2, 0.3])
    assert [r.finish for r in rs] == pytest.approx([0.1, 0.2, 0.3])


def test_decode_then_next_prefill_hand_trace() -> None:
    sim = one_replica()
    a, b = req(1, list(range(100)), 3), req(2, list(range(500, 600)), 1)
    submit_at(sim, a)
    submit_at(sim, b)
    sim.run()
    # a: prefill 0.1 -> first token; 2 decode steps of 0.01 -> done 0.12; then b's prefill 0.1.
    assert (a.ttft, a.finish) == pytest.approx((0.1, 0.12))
    assert (b.ttft, b.finish) == pytest.approx((0.22, 0.22))


def test_prefix_cache_hit_shortens_prefill() -> None:
    sim = one_replica()
    shared = list(range(96))  # 6 full blocks
    a, b = req(1, shared + [7, 7, 7, 7], 1), req(2, shared + [9, 9, 9, 9], 1, t=1.0)
    submit_at(sim, a)
    submit_at(sim, b)
    sim.run()
    assert a.ttft == pytest.approx(0.1) and a.cached_tokens == 0
    assert b.cached_tokens == 96 and b.ttft == pytest.approx(0.004)  # 4 uncached tokens


def test_batched_admission_and_mid_decode_arrival() -> None:
    sim = one_replica(max_batch=2)
    a = req(1, list(range(100)), 11)
    b = req(2, list(range(500, 550)), 1, t=0.125)
    submit_at(sim, a)
    submit_at(sim, b)
    sim.run()
    # a: first token 0.1, decode steps every 0.01. b arrives at 0.125 and is admitted at the next step
    # boundary, 0.13 (a has 4 tokens). That step decodes a and prefills b: 0.01 + 50/1000 = 0.06 -> 0.19.
    # a then needs 11 - 5 = 6 more steps: done at 0.25.
    assert b.first_token == pytest.approx(0.19) and b.ttft == pytest.approx(0.065)
    assert a.ttft == pytest.approx(0.1) and a.finish == pytest.approx(0.25)


def test_kv_capacity_blocks_admission() -> None:
    # 2 sequences fit the batch but not the KV: 8 blocks, each request needs 5 (64 + 16 tokens).
    sim = one_replica(max_batch=2, kv_blocks=8)
    a, b = req(1, list(range(64)), 16), req(2, list(range(100, 164)), 16)
    submit_at(sim, a)
    submit_at(sim, b)
    sim.run()
    assert b.first_token >= a.finish - 1e-12  # b waited for a's blocks


def test_md1_mean_wait_matches_pollaczek_khinchine() -> None:
    sim = one_replica()
    d, rho, n = 0.1, 0.6, 20000  # service: 100 tokens at 1000 tok/s, no caching (no full blocks shared)
    rng = random.Random(7)
    t, reqs = 0.0, []
    for i in range(n):
        t += rng.expovariate(rho / d)
        r = SimRequest(i, [], 100, 1, t)
        reqs.append(r)
        submit_at(sim, r)
    sim.run()
    mean_ttft = sum(r.ttft for r in reqs[1000:]) / (n - 1000)
    expected = d + rho * d / (2 * (1 - rho))  # M/D/1: W = D + rho D / (2 (1 - rho)) = 0.175
    assert mean_ttft == pytest.approx(expected, rel=0.08)


def _agentic(profile: str) -> dict[str, float]:
    models = {f"r{i}": ReplicaModel(kv_blocks=2048) for i in range(8)}
    sim = Simulator(EndpointPicker(parse_config({}), seed=1), models, profile)
    wl = AgenticWorkload(system_tokens=512, first_user_tokens=256, tool_tokens=128, output_tokens=32, turns=(3, 6),
                         tool_latency_mean_s=1.4)
    return summarize(run_agentic(sim, wl, concurrency=24, duration_s=30, warmup_s=5, seed=3))


def test_prefix_aware_profiles_beat_round_robin_on_cache_hits() -> None:
    rr, sticky = _agentic("round-robin"), _agentic("sticky")
    # Under round-robin a session's turn lands on its previous replica ~1/8 of the time; under
    # the sticky profile nearly always, so far more of each prompt is served from cache.
    assert sticky["prefix_hit_ratio"] > rr["prefix_hit_ratio"] + 0.2
    assert rr["requests"] > 50 and not math.isnan(sticky["ttft_mean"])


def test_shared_prefix_workload_runs_and_hits() -> None:
    models = {f"r{i}": ReplicaModel() for i in range(4)}
    sim = Simulator(EndpointPicker(parse_config({}), seed=1), models, "prefix-aware")
    res = summarize(run_shared_prefix(sim, SharedPrefixWorkload(groups=4, prefix_tokens=512, suffix_tokens=64),
                                      concurrency=8, duration_s=10, warmup_s=2, seed=0))
    assert res["prefix_hit_ratio"] > 0.6  # 512 of 576 tokens are a shared prefix


# -- KV block pool, eviction-driven recompute, chunked prefill, scrape lag -----------------------


def test_shared_prefix_blocks_counted_once_in_kv() -> None:
    # kv 12 blocks of 16. a and b share 8 prompt blocks (128 tokens); each has 16 more prompt tokens
    # (1 block) and 16 output tokens (1 block): 10 blocks each if counted separately (20 > 12), but
    # with the 8 shared blocks counted once they need 8 + 2 + 2 = 12: both run at the same time.
    sim = one_replica(max_batch=2, kv_blocks=12)
    shared = list(range(128))
    a = req(1, shared + list(range(1000, 1016)), 16)
    b = req(2, shared + list(range(2000, 2016)), 16, t=0.2)
    submit_at(sim, a)
    submit_at(sim, b)
    sim.run()
    # a: prefill 144 tokens = 0.144 s, then decodes every 0.01 s. b arrives at 0.2 and is admitted
    # at the next step boundary 0.204 (a is mid-decode, not finished at 0.294): b hits 128 tokens.
    assert b.cached_tokens == 128
    assert b.first_token == pytest.approx(0.204 + 0.01 + 16 / 1000)
    assert b.first_token < a.finish


def test_evicted_context_is_recomputed_in_full() -> None:
    # kv 10 blocks. a (8 prompt blocks + 1 output block) finishes and leaves its 8 prompt blocks cached.
    # c (unrelated, 8 prompt blocks + 1 output) needs 9 of the 10 blocks, so 7 of a's cached blocks are
    # evicted, tail first: only a's first block survives. a2 (a's prompt + 16 new tokens) then hits
    # 1 block (16 tokens) and recomputes the remaining 128 + 16 - 16 = 128 tokens.
    sim = one_replica(kv_blocks=10)
    a_tokens = list(range(128))
    a = req(1, a_tokens, 1)
    c = req(2, list(range(5000, 5128)), 1, t=1.0)
    a2 = req(3, a_tokens + list(range(9000, 9016)), 1, t=2.0)
    for r in (a, c, a2):
        submit_at(sim, r)
    sim.run()
    assert a.cached_tokens == 0 and c.cached_tokens == 0
    assert a2.cached_tokens == 16
    assert a2.ttft == pytest.approx(128 / 1000)  # charged for every evicted token
    # With room for both, nothing is evicted and a2 only computes its 16 new tokens.
    sim = one_replica(kv_blocks=100)
    a, c, a2 = req(1, a_tokens, 1), req(2, list(range(5000, 5128)), 1, t=1.0), req(3, a_tokens + list(range(9000, 9016)), 1, t=2.0)
    for r in (a, c, a2):
        submit_at(sim, r)
    sim.run()
    assert a2.cached_tokens == 128 and a2.ttft == pytest.approx(16 / 1000)


def test_in_use_blocks_are_never_evicted() -> None:
    # a holds 9 of 10 blocks while decoding. c, arriving meanwhile, needs 9 more: it must wait for a
    # to finish instead of evicting a's in-use blocks.
    sim = one_replica(max_batch=2, kv_blocks=10)
    a = req(1, list(range(128)), 10)
    c = req(2, list(range(5000, 5128)), 1, t=0.15)
    submit_at(sim, a)
    submit_at(sim, c)
    sim.run()
    # a: prefill 0.128, 9 decode steps of 0.01 -> finish 0.218; c prefills 128 tokens after that.
    assert a.finish == pytest.approx(0.218)
    assert c.first_token == pytest.approx(0.218 + 0.128)


def test_output_blocks_join_the_prefix_cache() -> None:
    sim = one_replica()
    prompt, reply = list(range(100)), list(range(7000, 7028))  # 100 + 28 = 128 tokens = 8 full blocks
    full = prompt + reply
    a = SimRequest(1, block_hashes(prompt, 16), 100, 28, 0.0, final_hashes=block_hashes(full, 16))
    nxt = full + list(range(8000, 8016))
    b = req(2, nxt, 1, t=5.0)
    submit_at(sim, a)
    submit_at(sim, b)
    sim.run()
    assert b.cached_tokens == 128 and b.ttft == pytest.approx(16 / 1000)


def test_chunked_prefill_interleaves_decodes() -> None:
    # Budget 100 tokens per step. a (50 prompt tokens, 5 output) is decoding when b (250 tokens)
    # arrives. Each step then decodes a (1 token) and prefills 99 of b's tokens: 0.01 + 0.099.
    sim = one_replica(max_batch=2, max_batched_tokens=100)
    a = req(1, list(range(50)), 5)
    b = req(2, list(range(1000, 1250)), 1, t=0.051)
    submit_at(sim, a)
    submit_at(sim, b)
    sim.run()
    # a: prefill 50 tokens in one step -> first token 0.05; decode step boundary at 0.06 admits b.
    # Steps from 0.06: [a, b:99] 0.109 -> 0.169; [a, b:99] -> 0.278; [a, b:52] 0.062 -> 0.340 (b's
    # first token, a has 1 + 1 + 3 = 5 tokens: done).
    assert a.first_token == pytest.approx(0.05)
    assert b.first_token == pytest.approx(0.06 + 0.109 + 0.109 + 0.062)
    assert a.finish == pytest.approx(0.340)
    # Without a budget the whole prompt goes in one step: 0.06 + 0.01 + 0.25.
    sim = one_replica(max_batch=2)
    a, b = req(1, list(range(50)), 5), req(2, list(range(1000, 1250)), 1, t=0.051)
    submit_at(sim, a)
    submit_at(sim, b)
    sim.run()
    assert b.first_token == pytest.approx(0.32)


def test_scrape_lag_hides_load_until_the_next_scrape() -> None:
    m = ReplicaModel(prefill_tps=1000.0, decode_base_s=0.01, decode_per_seq_s=0.0, max_batch=1, kv_blocks=1000)
    picker = EndpointPicker(parse_config({}), seed=0)
    sim = Simulator(picker, {"r0": m}, "round-robin", scrape_interval_s=0.5)
    a = req(1, list(range(100)), 50)  # busy from 0 to 0.1 + 49 * 0.01 = 0.59
    submit_at(sim, a)
    seen = []
    for t in (0.05, 0.45, 0.55):
        sim.at(t, lambda: seen.append(float(picker.pool.running[0])))
    sim.run()
    assert seen == [0.0, 0.0, 1.0]  # first scrape at 0.5


def test_agentic_tool_latency_mean() -> None:
    wl = AgenticWorkload()
    rng = random.Random(0)
    xs = [rng.lognormvariate(wl.tool_latency_mu, wl.tool_latency_sigma) for _ in range(200000)]
    assert sum(xs) / len(xs) == pytest.approx(15.0, rel=0.02)


def test_prefill_attention_cost_grows_with_position() -> None:
    # 1e-5 s per query-key pair: 100 fresh prompt tokens see 1 + 2 + ... + 100 = 5,050 keys.
    sim = one_replica(prefill_attn_s=1e-5)
    a = req(1, list(range(100)), 1)
    submit_at(sim, a)
    sim.run()
    assert a.ttft == pytest.approx(0.1 + 5050e-5)
    # A cache hit of 96 tokens leaves 4 tokens at positions 96..99: 97 + 98 + 99 + 100 = 394 keys.
    sim = one_replica(prefill_attn_s=1e-5)
    shared = list(range(96))
    a, b = req(1, shared + [7, 7, 7, 7], 1), req(2, shared + [9, 9, 9, 9], 1, t=1.0)
    submit_at(sim, a)
    submit_at(sim, b)
    sim.run()
    assert b.cached_tokens == 96 and b.ttft == pytest.approx(0.004 + 394e-5)


def test_chunked_prefill_charges_each_chunk_its_offset() -> None:
    # Budget 100: a 250-token prompt runs as chunks of 100, 100, 50 at offsets 0, 100, 200.
    # Pairs: 100*0 + 5050, 100*100 + 5050, 50*200 + 1275 -> 5050, 15050, 11275 (31,375 in all,
    # the same as 250 * 251 / 2 in one piece).
    sim = one_replica(prefill_attn_s=1e-6, max_batched_tokens=100)
    a = req(1, list(range(250)), 1)
    submit_at(sim, a)
    sim.run()
    assert a.ttft == pytest.approx(0.25 + 31375e-6)


def test_decode_steps_grow_with_context() -> None:
    # decode_attn_s 1e-4 per context token: after a 100-token prefill (0.1 s, first token) the
    # decode steps see 101, 102, 103 keys: 0.01 + 0.0101, + 0.0102, + 0.0103.
    sim = one_replica(decode_attn_s=1e-4)
    a = req(1, list(range(100)), 4)
    submit_at(sim, a)
    sim.run()
    assert a.finish == pytest.approx(0.1 + 0.03 + 0.0306)


def test_arrival_mid_decode_waits_for_the_growing_step_boundary() -> None:
    # a decodes alone in one epoch with steps 0.0201, 0.0202, 0.0203, ... (boundaries 0.1201, 0.1403,
    # 0.1606). b arrives at 0.13 and is admitted at 0.1403, where a has 3 tokens; that step decodes a
    # (context 103: 0.0203) and prefills b's 50 tokens (0.05): b's first token at 0.2106.
    sim = one_replica(decode_attn_s=1e-4, max_batch=2)
    a = req(1, list(range(100)), 10)
    b = req(2, list(range(500, 550)), 1, t=0.13)
    submit_at(sim, a)
    submit_at(sim, b)
    sim.run()
    assert b.first_token == pytest.approx(0.1403 + 0.0203 + 0.05)
    # a's remaining 6 steps: contexts 104 .. 109 -> 0.06 + 1e-4 * (104 + ... + 109) = 0.06 + 0.0639.
    assert a.finish == pytest.approx(b.first_token + 0.06 + 0.0639)


def test_dedicated_route_gives_each_session_its_own_replica() -> None:
    m = ReplicaModel(prefill_tps=1000.0, decode_base_s=0.01, decode_per_seq_s=0.0, max_batch=8, kv_blocks=1000)
    sim = Simulator(EndpointPicker(parse_config({}), seed=0), {f"r{i}": m for i in range(4)}, "round-robin")
    sim.route = dedicated_route(sim)
    turn1 = list(range(64))
    a1 = SimRequest(1, block_hashes(turn1, 16), 64, 1, 0.0, session="a")
    b1 = SimRequest(2, block_hashes(list(range(500, 564)), 16), 64, 1, 0.0, session="b")
    a2 = SimRequest(3, block_hashes(turn1 + list(range(900, 916)), 16), 80, 1, 1.0, session="a")
    for r in (a1, b1, a2):
        submit_at(sim, r)
    sim.run()
    assert a1.replica == a2.replica != b1.replica
    # a's second turn finds its first turn's 64 tokens on its replica: only 16 new tokens computed.
    assert a2.cached_tokens == 64 and a2.ttft == pytest.approx(16 / 1000)
    assert a1.ttft == b1.ttft == pytest.approx(0.064)  # side by side, not queued behind each other
