"""The sticky-until-saturated picker."""

from __future__ import annotations

import numpy as np
from route_support import HASHES, make_ctx, mask

from torchbridge.route.scorers.sticky_until_saturated import StickyUntilSaturatedPicker


def test_sticky_until_saturated() -> None:
    # r1 holds 9/10 blocks. Prompt 160 tokens at 1000 tok/s: uncached on r1 = 16 tokens.
    p = StickyUntilSaturatedPicker("p", hit_threshold=0.8, max_extra_wait_s=0.5)
    ctx = make_ctx(pending_tokens=[0, 0, 0, 0])
    ctx.approx.insert(1, HASHES[:9])
    assert p.pick(ctx, mask(), np.zeros(4)) == 1
    # r1 has 600 queued tokens: wait 0.616 s vs 0.16 s elsewhere -> 0.456 s extra, within bound.
    ctx = make_ctx(pending_tokens=[0, 600, 0, 0])
    ctx.approx.insert(1, HASHES[:9])
    assert p.pick(ctx, mask(), np.zeros(4)) == 1
    # 700 queued: 0.716 - 0.16 = 0.556 s > 0.5 s bound -> the least-wait alternative (r3 is idle).
    ctx = make_ctx(pending_tokens=[50, 700, 80, 0])
    ctx.approx.insert(1, HASHES[:9])
    assert p.pick(ctx, mask(), np.zeros(4)) == 3
    # A hit below threshold (7/10) does not stick: the weighted scores decide.
    ctx = make_ctx()
    ctx.approx.insert(1, HASHES[:7])
    assert p.pick(ctx, mask(), np.array([0.0, 0.0, 1.0, 0.0])) == 2
