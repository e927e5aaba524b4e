"""The session-affinity scorer."""

from __future__ import annotations

from route_support import make_ctx, mask

from torchbridge.route.scorers.session_affinity import SessionAffinityScorer


def test_session_affinity() -> None:
    ctx = make_ctx(session="abc")
    ctx.sessions["abc"] = "r2"
    assert SessionAffinityScorer("s").score(ctx, mask()).tolist() == [0, 0, 1, 0]
    assert SessionAffinityScorer("s").score(make_ctx(session="zzz"), mask()).tolist() == [0, 0, 0, 0]
