"""The prefix-cache scorer."""

from __future__ import annotations

from route_support import HASHES, make_ctx, mask

from torchbridge.route.scorers.prefix_cache import PrefixCacheScorer


def test_prefix_scorer_uses_approx_and_precise() -> None:
    ctx = make_ctx()
    ctx.approx.insert(1, HASHES[:5])
    ctx.precise.insert(2, HASHES[:8])
    ctx.precise.insert(3, HASHES)  # r3 does not publish events: ignored
    ctx.pool.precise[2] = True
    assert PrefixCacheScorer("s").score(ctx, mask()).tolist() == [0, 0.5, 0.8, 0]
    assert PrefixCacheScorer("s", index="approx").score(ctx, mask()).tolist() == [0, 0.5, 0, 0]
    assert PrefixCacheScorer("s", index="precise").score(ctx, mask()).tolist() == [0, 0, 0.8, 0]
