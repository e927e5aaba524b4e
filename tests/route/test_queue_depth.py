"""The queue-depth scorer."""

from __future__ import annotations

from route_support import assert_min_max_inverse

from torchbridge.route.scorers.queue_depth import QueueDepthScorer


def test_queue_depth_scores_min_max_inverse() -> None:
    assert_min_max_inverse(QueueDepthScorer, "queue")
