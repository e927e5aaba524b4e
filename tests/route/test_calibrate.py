from __future__ import annotations

import pytest

from torchbridge.route.calibrate import _fit_prefill, calibrate


def test_calibrate_against_fake_replica(fake_replicas) -> None:
    (f,) = fake_replicas(1, num_blocks=777, block_size=32, delay_token_s=0.005)
    cal = calibrate(f.url, prompt_words=(8, 64), decode_tokens=6, batch=2, repeats=1)
    m = cal.model
    # Exact: read from vllm:cache_config_info.
    assert (m.kv_blocks, m.block_size) == (777, 32)
    # The fake's usage.prompt_tokens is len(json(prompt)), so the longer prompt must have more tokens.
    assert cal.prefill_points[1][0] > cal.prefill_points[0][0]
    # Shape only (no timing asserts): every fitted number is a positive finite rate/duration.
    assert m.prefill_tps > 0 and m.decode_base_s > 0 and m.decode_per_seq_s >= 0
    assert [b for b, _ in cal.decode_points] == [1, 2]


def test_calibrate_long_context_plumbing(fake_replicas) -> None:
    (f,) = fake_replicas(1, delay_token_s=0.005)
    cal = calibrate(f.url, prompt_words=(8, 64), decode_tokens=6, batch=2, repeats=1, context_words=(256,))
    assert len(cal.prefill_points) == 3 and cal.long_decode is not None
    assert cal.long_decode[0] == cal.prefill_points[2][0]  # the context of the 256-word prompt
    assert cal.model.prefill_attn_s >= 0 and cal.model.decode_attn_s >= 0 and cal.model.prefill_tps > 0


def test_prefill_fit_recovers_known_costs() -> None:
    # Points from a known replica: 10 ms fixed, 10,000 tok/s, 5e-8 s per query-key pair, +-1% noise.
    noise = [1.01, 0.99, 1.0, 1.01, 0.99, 1.0]
    ns = [90, 700, 2700, 5300, 10700, 29500]
    pts = [(n, (0.01 + n / 10_000 + 5e-8 * n * (n + 1) / 2) * e) for n, e in zip(ns, noise, strict=True)]
    tps, per_pair = _fit_prefill(pts, quadratic=True)
    assert tps == pytest.approx(10_000, rel=0.1)
    assert per_pair == pytest.approx(5e-8, rel=0.05)
    # Without the quadratic term: the slope of the two points.
    assert _fit_prefill([(100, 0.02), (1100, 0.12)], quadratic=False) == pytest.approx((10_000, 0.0))
