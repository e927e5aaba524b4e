"""The least-loaded picker."""

from __future__ import annotations

import numpy as np
from route_support import make_ctx, mask

from torchbridge.route.scorers.least_loaded import LeastLoadedPicker


def test_least_loaded_picker() -> None:
    ctx = make_ctx(inflight=[3, 1, 0, 2], queue=[0, 0, 4, 0])
    assert LeastLoadedPicker("p").pick(ctx, mask(), np.zeros(4)) == 1
