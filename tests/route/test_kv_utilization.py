"""The kv-cache-utilization scorer."""

from __future__ import annotations

from route_support import make_ctx, mask

from torchbridge.route.scorers.kv_utilization import KVUtilizationScorer


def test_kv_utilization_scorer() -> None:
    ctx = make_ctx(kv_usage=[0.0, 0.25, 1.0, 0.5])
    assert KVUtilizationScorer("s").score(ctx, mask()).tolist() == [1.0, 0.75, 0.0, 0.5]
