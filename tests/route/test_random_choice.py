"""The random picker."""

from __future__ import annotations

import numpy as np
from route_support import make_ctx

from torchbridge.route.scorers.random_choice import RandomPicker


def test_random_picker_covers_every_unmasked_replica() -> None:
    ctx = make_ctx()
    m = np.array([True, True, False, True])
    assert {RandomPicker("p").pick(ctx, m, np.zeros(4)) for _ in range(200)} == {0, 1, 3}
