"""The max-score picker."""

from __future__ import annotations

import numpy as np
from route_support import make_ctx

from torchbridge.route.scorers.max_score import MaxScorePicker


def test_max_score_picks_the_best_unmasked_and_spreads_ties() -> None:
    ctx = make_ctx()
    m = np.array([True, True, False, True])
    assert MaxScorePicker("p").pick(ctx, m, np.array([0.1, 0.9, 5.0, 0.3])) == 1  # masked-out 5.0 ignored
    ties = {MaxScorePicker("p").pick(ctx, m, np.zeros(4)) for _ in range(200)}
    assert ties == {0, 1, 3}  # ties are spread, not always the first
