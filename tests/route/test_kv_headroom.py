"""The kv-headroom filter."""

from __future__ import annotations

from route_support import make_ctx, mask

from torchbridge.route.scorers.kv_headroom import KVHeadroomFilter


def test_kv_headroom_filter() -> None:
    ctx = make_ctx(kv_usage=[0.5, 0.99, 0.9, 0.2])
    assert KVHeadroomFilter("f", max_usage=0.9).apply(ctx, mask()).tolist() == [True, False, True, True]
