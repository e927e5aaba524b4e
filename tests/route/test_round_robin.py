"""The round-robin picker."""

from __future__ import annotations

import numpy as np
from route_support import make_ctx

from torchbridge.route.scorers.round_robin import RoundRobinPicker


def test_round_robin_cycles_over_unmasked_replicas() -> None:
    ctx = make_ctx()
    m = np.array([True, True, False, True])
    rr = RoundRobinPicker("p")
    assert [rr.pick(ctx, m, np.zeros(4)) for _ in range(5)] == [0, 1, 3, 0, 1]
