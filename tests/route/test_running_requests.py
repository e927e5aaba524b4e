"""The running-requests scorer."""

from __future__ import annotations

from route_support import assert_min_max_inverse

from torchbridge.route.scorers.running_requests import RunningRequestsScorer


def test_running_requests_scores_min_max_inverse() -> None:
    assert_min_max_inverse(RunningRequestsScorer, "running")
