"""The low-queue filter."""

from __future__ import annotations

from route_support import make_ctx, mask

from torchbridge.route.scorers.low_queue import LowQueueFilter


def test_low_queue_filter_and_fallback() -> None:
    ctx = make_ctx(queue=[0, 5, 20, 3])
    assert LowQueueFilter("f", max_queue=4).apply(ctx, mask()).tolist() == [True, False, False, True]
    assert LowQueueFilter("f", max_queue=-1).apply(ctx, mask()).all()  # nobody passes: keep all
