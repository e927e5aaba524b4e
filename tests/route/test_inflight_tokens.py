"""The inflight-tokens scorer."""

from __future__ import annotations

from route_support import assert_min_max_inverse

from torchbridge.route.scorers.inflight_tokens import InflightTokensScorer


def test_inflight_tokens_scores_min_max_inverse() -> None:
    assert_min_max_inverse(InflightTokensScorer, "pending_tokens")
