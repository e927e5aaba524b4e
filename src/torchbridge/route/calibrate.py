"""Measure a running replica over HTTP and fit the simulator's `ReplicaModel` to it.

* prefill rate: latency of max_tokens=1 requests at two prompt lengths (unique text so the
  prefix cache cannot help); the slope is seconds per prompt token, using the replica's own
  `usage.prompt_tokens` count when it reports one;
* prefill attention (with `context_words`): more prompts up to long contexts; a least-squares fit
  of t = a + n / prefill_tps + prefill_attn_s * n (n + 1) / 2 over every prompt length (each point
  weighted by 1 / t, so short prompts count as much as long ones) splits the per-token cost from
  the per query-key pair cost of attention;
* decode step vs batch: mean gap between streamed chunks at batch 1 and at batch `batch`;
  two points fix decode_base_s and decode_per_seq_s; with `context_words`, the gap of one stream
  after the longest prompt gives decode_attn_s (seconds per context token per step);
* KV blocks and block size: vllm:cache_config_info from /metrics.
Each point takes the best of `repeats` runs, which filters scheduler noise on a shared host.
"""

from __future__ import annotations

import random
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import numpy as np

from .replicas import parse_engine_metrics
from .simulator import ReplicaModel


@dataclass
class Calibration:
    model: ReplicaModel
    prefill_points: list[tuple[int, float]]     # (prompt tokens, seconds)
    decode_points: list[tuple[int, float]]      # (batch, seconds per step)
    long_decode: tuple[int, float] | None = None  # (context tokens, seconds per step at batch 1)


def _prompt(n_words: int, rng: random.Random) -> str:
    # A fresh first word: no earlier request to this replica (another calibration run included)
    # shares a prefix block with it, so the prefix cache cannot shorten any measurement.
    return " ".join([f"n{secrets.token_hex(4)}"] + [f"w{rng.randrange(10**6)}" for _ in range(n_words - 1)])


def _timed_completion(client: httpx.Client, url: str, model: str | None, prompt: str) -> tuple[int, float]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, **({"model": model} if model else {})}
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json().get("usage") or {}
    n = int(usage.get("prompt_tokens") or max(1, len(prompt) // 4))
    return n, dt


def _stream_gaps(url: str, model: str | None, n_tokens: int, seed: int, words: int = 16) -> list[float]:
    body = {"prompt": _prompt(words, random.Random(seed)), "max_tokens": n_tokens, "stream": True,
            "temperature": 0.0, "ignore_eos": True, **({"model": model} if model else {})}
    stamps = []
    with httpx.Client(timeout=600) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[1:-1], stamps[2:], strict=False)] or [0.0]


def calibrate(url: str, model: str | None = None, prompt_words: tuple[int, int] = (16, 128),
              decode_tokens: int = 24, batch: int = 4, max_batch: int = 32, repeats: int = 2,
              seed: int = 0, context_words: tuple[int, ...] = ()) -> Calibration:
    url = url.rstrip("/")
    rng = random.Random(seed)
    with httpx.Client(timeout=3600) as c:
        info = parse_engine_metrics(c.get(url + "/metrics").text)
        pts = []
        for words in (*prompt_words, *context_words):
            runs = [_timed_completion(c, url, model, _prompt(words, rng)) for _ in range(repeats)]
            pts.append(min(runs, key=lambda x: x[1]))
    prefill_tps, prefill_attn_s = _fit_prefill(pts, quadratic=bool(context_words))

    def step_at(b: int) -> float:
        best = float("inf")
        for r in range(repeats):
            seeds = [seed * 1000 + r * 100 + i for i in range(b)]
            with ThreadPoolExecutor(b) as ex:
                gaps = list(ex.map(lambda sd: _stream_gaps(url, model, decode_tokens, sd), seeds))
            mean = sum(sum(g) / len(g) for g in gaps) / b
            best = min(best, mean)
        return best

    s1, sb = step_at(1), step_at(batch)
    per_seq = max(0.0, (sb - s1) / max(1, batch - 1))
    base = max(1e-4, s1 - per_seq)
    long_decode, decode_attn_s = None, 0.0
    if context_words:
        words = max(context_words)
        # Context of that stream: the measured prompt of the same word count (random words of one
        # form tokenize to nearly the same length).
        ctx = max(n for (n, _), w in zip(pts, (*prompt_words, *context_words), strict=True) if w == words)
        gaps = min((_stream_gaps(url, model, decode_tokens, seed * 1000 + 999 - r, words) for r in range(repeats)),
                   key=lambda g: float(np.median(g)))
        long_decode = (ctx, float(np.median(gaps)))
        decode_attn_s = max(0.0, (long_decode[1] - s1) / ctx)
    m = ReplicaModel(prefill_tps=prefill_tps, decode_base_s=base, decode_per_seq_s=per_seq,
                     kv_blocks=int(info.get("kv_blocks", 4096)), block_size=int(info.get("block_size", 16)),
                     max_batch=max_batch, prefill_attn_s=prefill_attn_s, decode_attn_s=decode_attn_s)
    return Calibration(m, pts, [(1, s1), (batch, sb)], long_decode)


def _fit_prefill(pts: list[tuple[int, float]], quadratic: bool) -> tuple[float, float]:
    """(prefill_tps, prefill_attn_s) from (prompt tokens, seconds) points: the slope of two points,
    or with `quadratic` a relative least-squares fit of a + n / tps + k * n (n + 1) / 2."""
    if not quadratic:
        (n1, t1), (n2, t2) = pts
        slope = (t2 - t1) / max(1, n2 - n1)
        return (1.0 / slope if slope > 0 else n2 / max(t2, 1e-6)), 0.0
    n = np.array([p[0] for p in pts], dtype=float)
    t = np.array([p[1] for p in pts], dtype=float)
    a = np.stack([np.ones_like(n), n, n * (n + 1) / 2], axis=1) / t[:, None]
    _, per_token, per_pair = np.linalg.lstsq(a, np.ones_like(t), rcond=None)[0]
    return (float(1.0 / per_token) if per_token > 0 else float(n.max() / t.max())), max(0.0, float(per_pair))
