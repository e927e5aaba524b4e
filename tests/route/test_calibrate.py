from __future__ import annotations

from torchbridge.route.calibrate import calibrate


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
