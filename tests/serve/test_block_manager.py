"""Block manager and scheduler bookkeeping: chained hashes (checked against xxhash directly), reference
counts, LRU eviction, KV events, and the scheduler's token budget."""

from __future__ import annotations

import xxhash

from torchbridge.serve.block_manager import BlockManager
from torchbridge.serve.kv_events import KVEventLog
from torchbridge.serve.sampling_params import SamplingParams
from torchbridge.serve.scheduler import Scheduler
from torchbridge.serve.sequence import Sequence


def reference_chain(tokens: list[int], block_size: int) -> list[int]:
    out, parent = [], 0
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size : (i + 1) * block_size]
        parent = xxhash.xxh64(parent.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in block)).intdigest()
        out.append(parent)
    return out


def seq(tokens: list[int]) -> Sequence:
    return Sequence("r", 0, tokens, SamplingParams())


def run_prefill(bm: BlockManager, s: Sequence) -> int:
    """Admit s like the scheduler does; returns the number of cached tokens."""
    cached = bm.lookup(s)
    bm.record_lookup(s, len(cached) * bm.block_size)
    bm.take_cached(s, cached)
    assert bm.allocate(s, len(s.token_ids))
    hit = s.num_computed_tokens
    s.num_computed_tokens = len(s.token_ids)
    bm.commit(s)
    return hit


def test_chained_hashes_and_sharing() -> None:
    events = KVEventLog()
    bm = BlockManager(16, 4, events=events)
    tokens = list(range(10, 24))  # 14 tokens: 3 full blocks
    a = seq(tokens)
    assert run_prefill(bm, a) == 0
    assert [bm.hashes[b] for b in a.block_table[:3]] == reference_chain(tokens, 4)
    assert bm.hashes[a.block_table[3]] is None  # the partial block is not shared
    b = seq(tokens[:12] + [99, 98])
    assert run_prefill(bm, b) == 12
    assert b.block_table[:3] == a.block_table[:3] and b.block_table[3] != a.block_table[3]
    assert all(bm.ref_counts[x] == 2 for x in a.block_table[:3])
    # A prompt that differs in the first block shares nothing (the chain makes later blocks differ too).
    c = seq([0] + tokens[1:])
    assert run_prefill(bm, c) == 0
    ev = events.since(0)
    assert ev["events"][0]["type"] == "stored" and ev["events"][0]["block_hashes"] == reference_chain(tokens, 4)
    assert ev["events"][0]["parent_block_hash"] is None and not ev["dropped"]


def test_fully_cached_prompt_leaves_one_token_to_compute() -> None:
    bm = BlockManager(16, 4)
    tokens = list(range(8))
    run_prefill(bm, seq(tokens))
    assert run_prefill(bm, seq(tokens)) == 4  # not 8: the last token must run to give logits


def test_release_keeps_blocks_cached_until_evicted_lru() -> None:
    bm = BlockManager(4, 2)
    x = seq([1, 2, 3, 4])
    run_prefill(bm, x)
    bm.release(x)
    assert bm.num_free_blocks == 4 and bm.usage == 0.0
    y = seq([7, 8, 9])  # takes the 2 never-hashed free blocks first: x's blocks stay cached
    run_prefill(bm, y)
    bm.release(y)
    assert run_prefill(bm, seq([1, 2, 3, 4, 5])) == 4
    # That sequence holds 3 of the 4 blocks: a 7-token prompt does not fit, and nothing changes.
    z = seq([20, 21, 22, 23, 24, 25, 26])
    assert not bm.allocate(z, 7) and z.block_table == []


def test_eviction_emits_removed_event() -> None:
    events = KVEventLog()
    bm = BlockManager(2, 2, events=events)
    a = seq([1, 2, 3])
    run_prefill(bm, a)
    h = bm.hashes[a.block_table[0]]
    bm.release(a)
    run_prefill(bm, seq([5, 6, 7, 8]))
    types = [(e["type"], e["block_hashes"]) for e in events.since(0)["events"]]
    assert ("removed", [h]) in types
    assert bm.lookup(seq([1, 2, 3])) == []


def test_event_log_bounds_and_dropped_flag() -> None:
    log = KVEventLog(capacity=3)
    for i in range(5):
        log.record("stored", block_hashes=[i])
    r = log.since(0)
    assert r["dropped"] and [e["id"] for e in r["events"]] == [2, 3, 4] and r["next"] == 5
    assert log.since(5) == {"events": [], "next": 5, "dropped": False}
    assert log.since(99)["dropped"]


def test_scheduler_token_budget_and_chunking() -> None:
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = seq(list(range(3, 17))), seq(list(range(20, 26)))
    sch.add(a)
    sch.add(b)
    batch = sch.schedule()
    assert [(it.seq, it.num_tokens) for it in batch.items] == [(a, 10)]
    assert batch.num_tokens == 10 and not batch.items[0].samples
    a.num_computed_tokens += 10
    batch = sch.schedule()
    assert [(it.seq, it.num_tokens) for it in batch.items] == [(a, 4), (b, 6)]
    assert all(it.samples for it in batch.items)


def test_scheduler_preempts_latest_when_pool_is_short() -> None:
    bm = BlockManager(4, 2, enable_prefix_caching=False)
    sch = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b = seq([1, 2, 3]), seq([4, 5, 6])
    sch.add(a)
    sch.add(b)
    sch.schedule()
    for s in (a, b):
        s.num_computed_tokens = 3
        s.token_ids.append(9)  # 4 tokens each: both fill their 2 blocks
    for s in (a, b):
        s.num_computed_tokens = 4
        s.token_ids.append(9)  # the 5th token needs a third block each; the pool has none left
    batch = sch.schedule()
    assert batch.preempted == [b] and [it.seq for it in batch.items] == [a]
    assert b.num_computed_tokens == 0 and b.block_table == [] and sch.num_preemptions == 1
    assert list(sch.waiting) == [b]
