"""The load scorer."""

from __future__ import annotations

from route_support import make_ctx, mask

from torchbridge.route.scorers.load import LoadScorer


def test_load_scorer_takes_larger_of_router_and_scrape() -> None:
    ctx = make_ctx(inflight=[4, 0, 0, 1], queue=[0, 1, 0, 0], running=[0, 1, 0, 0])
    # loads: 4, 2, 0, 1
    assert LoadScorer("s").score(ctx, mask()).tolist() == [0.0, 0.5, 1.0, 0.75]
