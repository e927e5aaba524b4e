"""The router in front of real `torchbridge serve` replicas (slow: engines load a model).

Runs with TB_SLOW=1 when a model is available: TORCHBRIDGE_ROUTE_TEST_MODEL=DIR, or the engine's
bundled default model once it is in the tree.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from route_support import wait_for

from torchbridge.route.cli import _stop, _wait_healthy, free_port
from torchbridge.route.prompt_tokens import HFTokenizer

BUNDLED = Path(__file__).resolve().parents[2] / "src" / "torchbridge" / "assets" / "default-model"
MODEL = os.environ.get("TORCHBRIDGE_ROUTE_TEST_MODEL") or (str(BUNDLED) if (BUNDLED / "config.json").exists() else "")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("TB_SLOW") != "1", reason="starts real engines; run with TB_SLOW=1"),
    pytest.mark.skipif(not MODEL, reason="no model: set TORCHBRIDGE_ROUTE_TEST_MODEL or add the bundled model"),
]


@pytest.fixture(scope="module")
def engines():  # noqa: ANN201
    procs, urls = [], []
    env = {**os.environ, "TORCHBRIDGE_NO_DEVICE": "1"}
    for _ in range(2):
        port = free_port()
        procs.append(subprocess.Popen([sys.executable, "-m", "torchbridge", "serve", "--device", "cpu", "--port",
                                       str(port), "--model", MODEL], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
        urls.append(f"http://127.0.0.1:{port}")
    try:
        for u, p in zip(urls, procs, strict=True):
            assert _wait_healthy(u, p, 300), f"engine {u} did not start"
        yield urls
    finally:
        _stop(procs)


def test_real_engines_kv_events_and_passthrough(engines, router) -> None:
    url, r = router(engines, tokenizer=HFTokenizer(MODEL), router={"default_profile": "prefix-aware"})
    wait_for(lambda: all(rep.engine.get("kv_blocks") for rep in r.pool.replicas.values()), what="cache config")
    prompt = "def add(a, b):\n    return a + b\n" * 12
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    first = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert first.status_code == 200
    home = first.headers["x-torchbridge-replica"]
    # The engine publishes the prompt's blocks; our hashes of the same tokens must find them.
    wait_for(lambda: r.picker.precise.match(r.picker.request(HFTokenizer(MODEL).encode_prompt(prompt)).hashes),
             timeout=30, what="precise index hit from the engine's KV events")
    assert r.pool.replicas[home].publishes_events
    again = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert again.headers["x-torchbridge-replica"] == home
    direct = httpx.post(r.pool.replicas[home].url + "/v1/completions", json=body, timeout=120)
    assert again.json()["choices"] == direct.json()["choices"]  # greedy: same text through the router
    streamed = httpx.post(url + "/v1/completions", json={**body, "stream": True}, timeout=120)
    assert streamed.status_code == 200 and streamed.text.rstrip().endswith("data: [DONE]")
