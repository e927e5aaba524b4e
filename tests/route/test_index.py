from __future__ import annotations

from route_support import reference_chain

from torchbridge.route.index import BlockIndex, block_hashes


def test_chain_matches_reference_and_drops_partial_block() -> None:
    toks = list(range(100, 150))  # 3 full blocks of 16 + 2 tokens
    assert block_hashes(toks, 16) == reference_chain(toks, 16)
    assert len(block_hashes(toks, 16)) == 3


def test_identical_prefixes_identical_keys_and_divergence_propagates() -> None:
    a = list(range(64))
    b = list(range(40)) + [999] + list(range(41, 64))  # differs in block 2 (tokens 32..47)
    ha, hb = block_hashes(a, 16), block_hashes(b, 16)
    assert ha[:2] == hb[:2]
    assert ha[2] != hb[2] and ha[3] != hb[3]  # block 3 has equal tokens but a different parent


def test_same_block_different_parent_differs() -> None:
    x = [7] * 16
    assert block_hashes([1] * 16 + x, 16)[1] != block_hashes([2] * 16 + x, 16)[1]


def test_continuation_equals_whole() -> None:
    toks = list(range(80))
    head = block_hashes(toks[:32], 16)
    assert head + block_hashes(toks[32:], 16, head[-1]) == block_hashes(toks, 16)


def test_match_longest_prefix_per_replica() -> None:
    ix = BlockIndex()
    h = block_hashes(list(range(160)), 16)  # 10 blocks
    ix.insert("a", h[:3])
    ix.insert("b", h)
    ix.insert("c", block_hashes(list(range(1000, 1160)), 16))
    assert ix.match(h) == {"a": 3, "b": 10}
    assert ix.match(h[:2]) == {"a": 2, "b": 2}
    assert ix.match([]) == {}


def test_match_with_many_holders_of_a_shared_head() -> None:
    ix = BlockIndex()
    shared = block_hashes(list(range(320)), 16)
    for i in range(100):  # > the small-set threshold, so the skip path is exercised
        ix.insert(f"r{i}", shared)
    own = block_hashes(list(range(320)) + list(range(5000, 5160)), 16)
    ix.insert("r7", own)
    ix.insert("r9", own[:25])
    m = ix.match(own)
    assert m["r7"] == 30 and m["r9"] == 25 and m["r0"] == 20 and len(m) == 100


def test_lru_capacity_evicts_tail_before_head() -> None:
    ix = BlockIndex()
    ix.add_replica("a", capacity=5)
    old = block_hashes(list(range(64)), 16)          # 4 blocks
    new = block_hashes(list(range(500, 532)), 16)    # 2 blocks
    ix.insert("a", old)
    ix.insert("a", new)
    assert ix.size("a") == 5
    # One block of `old` had to go: its tail, so its head stays matchable.
    assert ix.match(old) == {"a": 3}
    assert ix.match(new) == {"a": 2}
    ix.set_capacity("a", 2)  # shrinking evicts the least recently touched
    assert ix.size("a") == 2


def test_remove_and_clear() -> None:
    ix = BlockIndex()
    h = block_hashes(list(range(64)), 16)
    ix.insert("a", h)
    ix.insert("b", h)
    ix.remove("a", h[2:])
    assert ix.match(h) == {"a": 2, "b": 4}
    ix.clear("b")
    assert ix.match(h) == {"a": 2}
    ix.remove_replica("a")
    assert ix.match(h) == {} and ix.replicas() == ["b"]
