"""Measure a running replica over HTTP and fit the simulator's `ReplicaModel` to it.

* prefill rate: latency of max_tokens=1 requests at two prompt lengths (unique text so the
  prefix cache cannot help); the slope is seconds per prompt token, using the replica's own
  `usage.prompt_tokens` count when it reports one;
* decode step vs batch: mean gap between streamed chunks at batch 1 and at batch `batch`;
  two points fix decode_base_s and decode_per_seq_s;
* KV blocks and block size: vllm:cache_config_info from /metrics.
Each point takes the best of `repeats` runs, which filters scheduler noise on a shared host.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from .replicas import parse_engine_metrics
from .simulator import ReplicaModel


@dataclass
class Calibration:
    model: ReplicaModel
    prefill_points: list[tuple[int, float]]     # (prompt tokens, seconds)
    decode_points: list[tuple[int, float]]      # (batch, seconds per step)


def _prompt(n_words: int, rng: random.Random) -> str:
    return " ".join(f"w{rng.randrange(10**6)}" for _ in range(n_words))


def _timed_completion(client: httpx.Client, url: str, model: str | None, prompt: str) -> tuple[int, float]:
    body = {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, **({"model": model} if model else {})}
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body)
    dt = time.perf_counter() - t0
    r.raise_for_status()
    usage = r.json().get("usage") or {}
    n = int(usage.get("prompt_tokens") or max(1, len(prompt) // 4))
    return n, dt


def _stream_gaps(url: str, model: str | None, n_tokens: int, seed: int) -> list[float]:
    body = {"prompt": _prompt(16, random.Random(seed)), "max_tokens": n_tokens, "stream": True,
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
              seed: int = 0) -> Calibration:
    url = url.rstrip("/")
    rng = random.Random(seed)
    with httpx.Client(timeout=600) as c:
        info = parse_engine_metrics(c.get(url + "/metrics").text)
        pts = []
        for words in prompt_words:
            runs = [_timed_completion(c, url, model, _prompt(words, rng)) for _ in range(repeats)]
            pts.append(min(runs, key=lambda x: x[1]))
    (n1, t1), (n2, t2) = pts
    slope = (t2 - t1) / max(1, n2 - n1)
    prefill_tps = 1.0 / slope if slope > 0 else n2 / max(t2, 1e-6)

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
    m = ReplicaModel(prefill_tps=prefill_tps, decode_base_s=base, decode_per_seq_s=per_seq,
                     kv_blocks=int(info.get("kv_blocks", 4096)), block_size=int(info.get("block_size", 16)),
                     max_batch=max_batch)
    return Calibration(m, pts, [(1, s1), (batch, sb)])
