"""The proxy against fake replicas on loopback: passthrough, retries, flow control, admin, metrics."""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from route_support import reference_chain, wait_for

from torchbridge.route.proxy import REPLICA_HEADER

BODY = {"model": "fake-model", "prompt": "def fib(n):\n    " * 20, "max_tokens": 6}
CHAT = {"model": "fake-model", "messages": [{"role": "system", "content": "You are terse."},
                                            {"role": "user", "content": "Say hi " * 30}], "max_tokens": 5}


def _rr(**extra: object) -> dict:
    return {"router": {"default_profile": "round-robin", **extra}}


@pytest.mark.parametrize("path,body", [("/v1/completions", BODY), ("/v1/chat/completions", CHAT)])
@pytest.mark.parametrize("stream", [False, True])
def test_passthrough_is_byte_identical(fake_replicas, router, path, body, stream) -> None:
    (f,) = fake_replicas(1)
    url, _ = router([f.url])
    b = {**body, "stream": stream}
    direct = httpx.post(f.url + path, json=b)
    via = httpx.post(url + path, json=b)
    assert via.status_code == direct.status_code == 200
    assert via.content == direct.content
    assert via.headers["content-type"] == direct.headers["content-type"]
    assert via.headers[REPLICA_HEADER] == "r0"
    if stream:
        assert via.content.endswith(b"data: [DONE]\n\n")


def test_streamed_events_relayed_in_order(fake_replicas, router) -> None:
    (f,) = fake_replicas(1, delay_token_s=0.02)
    url, _ = router([f.url])
    with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True, "max_tokens": 5}) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert len(events) == 5 + 2  # tokens, the finish chunk, [DONE]
    assert json.loads(events[0][6:])["choices"][0]["text"] == " t0"


def test_openai_client_through_router_matches_direct(fake_replicas, router) -> None:
    (f,) = fake_replicas(1)
    url, _ = router([f.url])
    via = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    direct = openai.OpenAI(base_url=f.url + "/v1", api_key="x", max_retries=0)
    a = via.completions.create(model="fake-model", prompt="hello world", max_tokens=4)
    b = direct.completions.create(model="fake-model", prompt="hello world", max_tokens=4)
    assert a.model_dump() == b.model_dump() and a.choices[0].text == " t0 t1 t2 t3"
    msgs = [{"role": "user", "content": "hi"}]
    sa = [c.model_dump() for c in via.chat.completions.create(model="fake-model", messages=msgs, max_tokens=3,
                                                              stream=True)]
    sb = [c.model_dump() for c in direct.chat.completions.create(model="fake-model", messages=msgs, max_tokens=3,
                                                                 stream=True)]
    assert sa == sb and "".join(c["choices"][0]["delta"].get("content") or "" for c in sa) == " t0 t1 t2"
    assert [m.id for m in via.models.list().data] == ["fake-model"]


def test_retry_on_5xx_before_response_loses_nothing(fake_replicas, router) -> None:
    bad, good = fake_replicas(2)
    bad.knobs.fail_status = 503
    url, r = router([bad.url, good.url], **_rr())
    for i in range(8):
        resp = httpx.post(url + "/v1/completions", json={**BODY, "prompt": f"p{i}", "stream": i % 2 == 1})
        assert resp.status_code == 200 and resp.headers[REPLICA_HEADER] == "r1"
    assert len(good.knobs.received) == 8
    assert len(bad.knobs.received) >= 1  # it really was tried (round-robin sends it half the picks)


def _closing_server() -> tuple[str, threading.Event]:
    """Accepts connections and closes them without a byte: a replica dying before it responds."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.1)
    stop = threading.Event()

    def loop() -> None:
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except TimeoutError:
                continue
            c.recv(65536)
            c.close()
        srv.close()

    threading.Thread(target=loop, daemon=True).start()
    return f"http://127.0.0.1:{srv.getsockname()[1]}", stop


def test_retry_on_connection_drop_and_dead_replica(fake_replicas, router) -> None:
    (good,) = fake_replicas(1)
    dropper, stop = _closing_server()
    dead = fake_replicas(1)[0]
    dead.server.stop()  # connection refused from now on
    try:
        url, r = router([dropper, dead.url, good.url], **_rr(retries=2), health={"interval_s": 60})
        results = [httpx.post(url + "/v1/completions", json={**BODY, "prompt": f"q{i}"}) for i in range(6)]
        assert [x.status_code for x in results] == [200] * 6
        assert {x.headers[REPLICA_HEADER] for x in results} == {"r2"}
        assert len(good.knobs.received) == 6
        # The failures also took the bad replicas out of rotation (passive health).
        assert not r.pool.replicas["r0"].healthy and not r.pool.replicas["r1"].healthy
    finally:
        stop.set()


def test_all_replicas_failing_gives_openai_error(fake_replicas, router) -> None:
    a, b = fake_replicas(2, fail_status=500)
    url, _ = router([a.url, b.url], **_rr(retries=1))
    resp = httpx.post(url + "/v1/completions", json=BODY)
    assert resp.status_code == 500  # the last replica's own error is passed on
    assert len(a.knobs.received) == len(b.knobs.received) == 1


def test_client_errors_are_not_retried(fake_replicas, router) -> None:
    a, b = fake_replicas(2, fail_status=400)
    url, _ = router([a.url, b.url], **_rr())
    resp = httpx.post(url + "/v1/completions", json=BODY)
    assert resp.status_code == 400
    assert len(a.knobs.received) + len(b.knobs.received) == 1


def test_bad_json_and_unknown_profile(fake_replicas, router) -> None:
    (f,) = fake_replicas(1)
    url, _ = router([f.url])
    r = httpx.post(url + "/v1/completions", content=b"{nope")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.post(url + "/v1/completions", json=BODY, headers={"x-route-profile": "nope"})
    assert r.status_code == 400 and "unknown routing profile" in r.json()["error"]["message"]
    assert f.knobs.received == []


def test_429_past_the_queue_bound(fake_replicas, router) -> None:
    hold = threading.Event()
    (f,) = fake_replicas(1, hold=hold)
    url, r = router([f.url], flow_control={"max_inflight": 2, "max_queue": 1})
    with ThreadPoolExecutor(3) as ex:
        futs = [ex.submit(httpx.post, url + "/v1/completions", json={**BODY, "prompt": f"x{i}"}, timeout=30)
                for i in range(3)]
        wait_for(lambda: r.flow.inflight == 2 and r.flow.waiting == 1, what="2 in flight + 1 queued")
        rejected = httpx.post(url + "/v1/completions", json=BODY)
        assert rejected.status_code == 429
        err = rejected.json()["error"]
        assert err["type"] == "rate_limit_exceeded" and err["code"] == "router_queue_full" and err["message"]
        hold.set()
        assert [fu.result().status_code for fu in futs] == [200, 200, 200]
    assert len(f.knobs.received) == 3  # the rejected one never reached the replica
    m = httpx.get(url + "/metrics").text
    assert "router_rejected_total 1.0" in m


def test_runtime_add_and_remove(fake_replicas, router) -> None:
    a, b = fake_replicas(2)
    url, r = router([a.url], **_rr())
    resp = httpx.post(url + "/admin/replicas", json={"name": "extra", "url": b.url})
    assert resp.status_code == 201
    served = {httpx.post(url + "/v1/completions", json={**BODY, "prompt": f"a{i}"}).headers[REPLICA_HEADER]
              for i in range(4)}
    assert served == {"r0", "extra"}
    assert httpx.delete(url + "/admin/replicas/r0").status_code == 200
    assert httpx.delete(url + "/admin/replicas/r0").status_code == 404
    before = len(a.knobs.received)
    served = {httpx.post(url + "/v1/completions", json={**BODY, "prompt": f"b{i}"}).headers[REPLICA_HEADER]
              for i in range(4)}
    assert served == {"extra"} and len(a.knobs.received) == before
    names = [x["name"] for x in httpx.get(url + "/admin/replicas").json()["replicas"]]
    assert names == ["extra"]
    assert httpx.post(url + "/admin/replicas", json={"url": "ftp://x"}).status_code == 400


def test_reload_from_config_file(fake_replicas, tmp_path) -> None:
    from fake_replica import ServerThread

    from torchbridge.route.cli import free_port
    from torchbridge.route.config import load_config
    from torchbridge.route.proxy import create_app

    a, b = fake_replicas(2)
    p = tmp_path / "r.yaml"
    p.write_text(f"router: {{default_profile: round-robin}}\nreplicas: [{{name: a, url: '{a.url}'}}]\n")
    s = ServerThread(create_app(load_config(p)), free_port()).start()
    try:
        p.write_text(f"router: {{default_profile: random}}\nreplicas: [{{name: b, url: '{b.url}'}}]\n")
        out = httpx.post(s.url + "/admin/reload").json()
        assert out["added"] == ["b"] and out["removed"] == ["a"]
        assert httpx.post(s.url + "/v1/completions", json=BODY).headers[REPLICA_HEADER] == "b"
        p.write_text("router: {block_size: 0}\n")
        bad = httpx.post(s.url + "/admin/reload")
        assert bad.status_code == 400 and "router.block_size" in bad.json()["error"]["message"]
    finally:
        s.stop()


def test_health_checks_take_replicas_out_and_back(fake_replicas, router) -> None:
    a, b = fake_replicas(2)
    url, r = router([a.url, b.url], **_rr())
    a.knobs.healthy = False
    wait_for(lambda: not r.pool.replicas["r0"].healthy, what="r0 marked unhealthy")
    served = {httpx.post(url + "/v1/completions", json={**BODY, "prompt": f"h{i}"}).headers[REPLICA_HEADER]
              for i in range(4)}
    assert served == {"r1"}
    b.knobs.healthy = False
    wait_for(lambda: not r.pool.replicas["r1"].healthy, what="r1 marked unhealthy")
    assert httpx.get(url + "/health").status_code == 503
    assert httpx.post(url + "/v1/completions", json=BODY).status_code == 503
    a.knobs.healthy = True
    wait_for(lambda: r.pool.replicas["r0"].healthy, what="r0 back")
    assert httpx.post(url + "/v1/completions", json=BODY).headers[REPLICA_HEADER] == "r0"


def test_down_replica_gauges_are_dropped_not_kept(fake_replicas, router) -> None:
    (f,) = fake_replicas(1, queue=7, running=3, kv_usage=0.5)
    url, r = router([f.url])
    wait_for(lambda: 'router_replica_queue{replica="r0"} 7.0' in httpx.get(url + "/metrics").text, what="scrape")
    f.knobs.healthy = False
    wait_for(lambda: not r.pool.replicas["r0"].healthy, what="r0 marked unhealthy")
    metrics = httpx.get(url + "/metrics").text
    assert 'router_replica_healthy{replica="r0"} 0.0' in metrics
    for name in ("router_replica_queue", "router_replica_running", "router_replica_kv_usage"):
        assert f'{name}{{replica="r0"}}' not in metrics, name
    assert r.picker.pool.queue[r.picker.pool.slots["r0"]] == 0
    f.knobs.healthy = True
    wait_for(lambda: 'router_replica_queue{replica="r0"} 7.0' in httpx.get(url + "/metrics").text, what="rescrape")


def test_a_scrape_in_flight_when_the_replica_goes_down_is_discarded(fake_replicas, router) -> None:
    (f,) = fake_replicas(1, queue=7, running=3, kv_usage=0.5)
    url, r = router([f.url])
    wait_for(lambda: 'router_replica_queue{replica="r0"} 7.0' in httpx.get(url + "/metrics").text, what="scrape")
    f.knobs.delay_metrics_s = 1.0  # every scrape from now on answers after the health check has failed
    time.sleep(0.3)
    f.knobs.healthy = False
    wait_for(lambda: not r.pool.replicas["r0"].healthy, what="r0 marked unhealthy")
    down_at = time.time()
    while time.time() < down_at + 1.5:  # the scrape in flight answers meanwhile; the next failed check would hide it
        assert 'router_replica_queue{replica="r0"}' not in httpx.get(url + "/metrics").text
        time.sleep(0.03)
    assert r.pool.replicas["r0"].last_scrape < down_at and r.picker.pool.queue[r.picker.pool.slots["r0"]] == 0


def test_body_over_the_limit_is_413_and_the_router_goes_on(fake_replicas, router) -> None:
    (f,) = fake_replicas(1)
    url, _ = router([f.url], router={"max_request_bytes": 4096})
    r = httpx.post(url + "/v1/completions", json={**BODY, "prompt": "x" * 10_000})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert r.headers["connection"] == "close" and not f.knobs.received

    def chunks():  # noqa: ANN202 - no Content-Length: cut off while reading
        yield b'{"prompt": "'
        for _ in range(10):
            yield b"y" * 1000
        yield b'"}'

    assert httpx.post(url + "/v1/completions", content=chunks()).status_code == 413
    assert httpx.post(url + "/v1/completions", json=BODY).status_code == 200


def test_admin_needs_the_token(fake_replicas, router) -> None:
    (f,) = fake_replicas(1)
    url, _ = router([f.url], router={"admin_token": "s3cret"})
    assert httpx.get(url + "/admin/replicas").status_code == 401
    bad = httpx.post(url + "/admin/replicas", json={"url": "http://evil:1"}, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_admin_token"
    ok = httpx.get(url + "/admin/replicas", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and [x["name"] for x in ok.json()["replicas"]] == ["r0"]
    assert httpx.post(url + "/v1/completions", json=BODY).status_code == 200  # the API itself needs no token


def test_admin_without_token_is_off_unless_on_loopback(fake_replicas, router) -> None:
    (f,) = fake_replicas(1)
    url, _ = router([f.url], listen_host="0.0.0.0")
    r = httpx.post(url + "/admin/replicas", json={"url": "http://evil:1"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
    url, _ = router([f.url])  # listening on loopback: open to local callers, as before
    assert httpx.get(url + "/admin/replicas").status_code == 200


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_scrapes_engine_metrics(fake_replicas, router, engine) -> None:
    (f,) = fake_replicas(1, engine=engine, queue=7, running=3, kv_usage=0.25, num_blocks=123)
    url, r = router([f.url])
    slot = r.picker.pool.slots["r0"]
    wait_for(lambda: r.picker.pool.queue[slot] == 7, what="scrape")
    assert r.picker.pool.running[slot] == 3 and r.picker.pool.kv_usage[slot] == 0.25
    info = httpx.get(url + "/admin/replicas").json()["replicas"][0]
    if engine == "vllm":  # only vLLM exports the cache config: it sizes the approximate LRU
        assert info["kv_blocks"] == 123 and info["approx_capacity"] == 123
    metrics = httpx.get(url + "/metrics").text
    assert 'router_replica_queue{replica="r0"} 7.0' in metrics


def test_router_metrics_exposure(fake_replicas, router) -> None:
    a, b = fake_replicas(2)
    url, _ = router([a.url, b.url], **_rr())
    long = "shared context line\n" * 40
    for i in range(6):
        httpx.post(url + "/v1/completions", json={**BODY, "prompt": long + str(i)},
                   headers={"x-route-profile": "prefix-aware" if i >= 2 else "round-robin"})
    fams = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    dec = {(s.labels["replica"], s.labels["profile"]): s.value for s in fams["router_decisions"].samples
           if s.name == "router_decisions_total"}
    assert dec[("r0", "round-robin")] == 1 and dec[("r1", "round-robin")] == 1
    assert sum(v for (_, p), v in dec.items() if p == "prefix-aware") == 4
    count = [s.value for s in fams["router_decision_latency_seconds"].samples if s.name.endswith("_count")]
    assert count == [6]
    hit = fams["router_prefix_hit_ratio"].samples[0].value
    blocks = [s.value for s in fams["router_prefix_blocks"].samples if s.name.endswith("_total")][0]
    hits = [s.value for s in fams["router_prefix_hit_blocks"].samples if s.name.endswith("_total")][0]
    assert hits > 0 and hit == pytest.approx(hits / blocks)
    assert {s.labels["code"] for s in fams["router_requests"].samples if s.name.endswith("_total")} == {"200"}


def test_session_and_prefix_affinity_end_to_end(fake_replicas, router) -> None:
    fakes = fake_replicas(3)
    url, _ = router([f.url for f in fakes])
    # Multi-turn sessions: each turn extends the previous prompt; a session must stay put.
    homes = {}
    for s in range(4):
        ctx = f"session {s} system prompt with some shared text\n" * 10
        seen = set()
        for turn in range(4):
            ctx += f"turn {turn}: user asks something, model answers something\n" * 3
            resp = httpx.post(url + "/v1/completions", json={**BODY, "prompt": ctx}, headers={"x-session-id": f"s{s}"})
            seen.add(resp.headers[REPLICA_HEADER])
        assert len(seen) == 1
        homes[s] = seen.pop()
    assert len(set(homes.values())) >= 2  # different sessions spread out


class ExactTokenizer:
    """Test double standing in for the engine's tokenizer: whitespace-separated integers."""

    name = "ints"
    exact = True

    def encode_prompt(self, prompt: str) -> list[int]:
        return [int(t) for t in prompt.split()]

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return [int(t) for m in messages for t in m["content"].split()]


def test_kv_events_feed_the_precise_index(fake_replicas, router) -> None:
    fakes = fake_replicas(3)
    tokens = list(range(1000, 1000 + 16 * 6))
    hashes = reference_chain(tokens, 16)
    # Replica 2 reports having stored the first 5 blocks (in two runs) and evicted none.
    fakes[2].knobs.kv_events = [
        {"id": 0, "type": "stored", "block_hashes": hashes[:2], "parent_block_hash": None, "block_size": 16},
        {"id": 1, "type": "stored", "block_hashes": hashes[2:5], "parent_block_hash": hashes[1], "block_size": 16},
    ]
    url, r = router([f.url for f in fakes], tokenizer=ExactTokenizer(), router={"default_profile": "prefix-aware"})
    wait_for(lambda: r.pool.replicas["r2"].events_seen == 2, what="events applied")
    assert r.pool.replicas["r0"].publishes_events is False  # 404 -> approximate only
    prompt = " ".join(map(str, tokens))
    resp = httpx.post(url + "/v1/completions", json={**BODY, "prompt": prompt},
                      headers={"x-route-profile": "prefix-aware"})
    assert resp.headers[REPLICA_HEADER] == "r2"
    # An eviction event takes the head away: the replica no longer looks like a hit, in either index.
    fakes[2].knobs.kv_events.append({"id": 2, "type": "removed", "block_hashes": [hashes[0]]})
    wait_for(lambda: r.pool.replicas["r2"].events_seen == 3, what="eviction applied")
    assert r.picker.precise.match(hashes) == {}
    assert r.picker.pool.slots["r2"] not in r.picker.approx.match(hashes)
