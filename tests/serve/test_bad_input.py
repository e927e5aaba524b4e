"""Inputs that must never hurt the server: each is answered 4xx with an OpenAI-style error body, and
afterwards a normal request succeeds and /health is 200 (issue 17's list, reproduced one per test)."""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from serve_support import API_KEY

MODEL = "tiny-llama"
HEADERS = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def post(base: str, path: str, body: object, **kw: object) -> httpx.Response:
    return httpx.post(base + path, content=json.dumps(body).encode(), headers=HEADERS, timeout=60, **kw)


def assert_still_serving(base: str) -> None:
    assert httpx.get(base + "/health", timeout=10).status_code == 200
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param or err["param"].startswith(param + "."), err
    return err


# Bodies that are valid JSON with out-of-range values. NaN/Infinity are JSON extensions Python's parser
# (and so the server's) accepts, which is how a client's float('nan') arrives.
BAD_BODIES = [
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": float("nan")}, "top_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"presence_penalty": float("-inf")}, "presence_penalty"),
    ({"seed": 2**70}, "seed"),
    ({"seed": -(2**70)}, "seed"),
    ({"n": 10**9}, "n"),
    ({"top_k": 10**30}, "top_k"),
    ({"max_tokens": 1_000_000_000}, "max_tokens"),
    ({"max_tokens": 4, "min_tokens": 9}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stop_token_ids": [10**6]}, "stop_token_ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
    ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"stream": "maybe"}, "stream"),
]


@pytest.mark.parametrize("extra, param", BAD_BODIES, ids=[json.dumps(b[0])[:40] for b in BAD_BODIES])
def test_out_of_range_values_are_400(server: tuple, extra: dict, param: str) -> None:
    base = server[0]
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                 "max_tokens": 2})):
        assert_openai_error(post(base, path, {**body, **extra}), 400, param)
    assert_still_serving(base)


def test_tiny_repetition_penalty_samples_instead_of_crashing(server: tuple) -> None:
    """1e-45 is a valid (positive) penalty; it sends seen tokens' logits to +inf, which used to give a NaN
    distribution and kill the engine thread. The distribution is then uniform over those tokens."""
    base = server[0]
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 4,
                                       "repetition_penalty": 1e-45, "temperature": 1.0, "seed": 3})
    assert r.status_code == 200, r.text
    assert_still_serving(base)


def test_lone_surrogate_is_400(server: tuple) -> None:
    base = server[0]
    raw = b'{"model": "tiny-llama", "prompt": "a \\ud800 b", "max_tokens": 2}'
    r = httpx.post(base + "/v1/completions", content=raw, headers=HEADERS, timeout=30)
    assert_openai_error(r, 400, "prompt")
    raw = b'{"model": "tiny-llama", "messages": [{"role": "user", "content": "x\\udfff"}]}'
    r = httpx.post(base + "/v1/chat/completions", content=raw, headers=HEADERS, timeout=30)
    assert_openai_error(r, 400, "messages.0.content")
    assert_still_serving(base)


def test_max_tokens_beyond_context_is_400_like_vllm(server: tuple) -> None:
    base = server[0]
    err = assert_openai_error(post(base, "/v1/completions", {"model": MODEL, "prompt": [5] * 10, "max_tokens": 503}),
                              400, "max_tokens")
    assert "maximum context length is 512" in err["message"]
    # Exactly filling the context is allowed; an unspecified max_tokens is capped, not refused.
    assert post(base, "/v1/completions", {"model": MODEL, "prompt": [5] * 509, "max_tokens": 3}).status_code == 200
    assert post(base, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                               "max_tokens": 2}).status_code == 200


def test_long_prompt_refused_before_tokenizing(inproc_server: tuple) -> None:
    """A prompt with more characters than max_model_len tokens can hold is refused by its length alone."""
    base, engine = inproc_server
    calls = []
    tok = engine.engine.tokenizer
    original = tok.encode
    tok.encode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        r = post(base, "/v1/completions", {"model": MODEL, "prompt": "word " * 200_000, "max_tokens": 2})
    finally:
        tok.encode = original
    err = assert_openai_error(r, 400, "prompt")
    assert "maximum context length" in err["message"] and not calls
    assert_still_serving(base)


def test_body_over_the_limit_is_413_before_reading(server: tuple) -> None:
    """The fixture's limit is 1 MiB. A declared Content-Length over it is answered without reading the
    body (the socket write of 8 MiB would otherwise block), with Connection: close."""
    base = server[0]
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\nContent-Length: 8388608\r\n\r\n{\"prompt\": \"")
        head = s.recv(65536).decode()
    assert head.startswith("HTTP/1.1 413") and "connection: close" in head.lower(), head
    assert '"code":"request_too_large"' in head.replace(" ", "")
    # A chunked upload (no Content-Length) is cut off once it passes the limit.
    def chunks():  # noqa: ANN202
        yield b'{"model": "tiny-llama", "prompt": "'
        for _ in range(40):
            yield b"a" * 65536
        yield b'"}'

    r = httpx.post(base + "/v1/completions", content=chunks(), headers=HEADERS, timeout=30)
    assert_openai_error(r, 413)
    assert_still_serving(base)


def test_internal_error_keeps_the_connection_usable(inproc_server: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 500 is a complete response: the same keep-alive connection serves the next request."""
    base, engine = inproc_server

    def boom(*a: object, **k: object) -> None:
        raise RuntimeError("injected")

    with httpx.Client(base_url=base, headers=HEADERS, timeout=30) as c:
        monkeypatch.setattr(engine.engine.metrics, "render", boom)
        r = c.get("/metrics")
        assert_openai_error(r, 500)
        assert r.headers.get("connection", "keep-alive").lower() != "close"
        monkeypatch.undo()
        r2 = c.get("/metrics")
        assert r2.status_code == 200
        # One connection served both: httpx's pool reused it.
        assert r.extensions["network_stream"] is r2.extensions["network_stream"]


def test_step_failure_fails_only_its_request(inproc_server: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sampler failure on one row fails that request (500), and the request batched with it completes."""
    import threading

    base, engine = inproc_server
    sampler = engine.engine.sampler
    original = sampler.sample

    def poisoned(logits, seqs):  # noqa: ANN001, ANN202
        if any(s.params.seed == 4242 for s in seqs):
            raise RuntimeError("injected sampler failure")
        return original(logits, seqs)

    monkeypatch.setattr(sampler, "sample", poisoned)
    results: dict[str, httpx.Response] = {}

    def send(name: str, seed: int) -> None:
        results[name] = post(base, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 24,
                                                       "temperature": 1.0, "seed": seed, "ignore_eos": True})

    threads = [threading.Thread(target=send, args=(n, s)) for n, s in (("bad", 4242), ("good", 1))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert_openai_error(results["bad"], 500)
    assert results["good"].status_code == 200 and results["good"].json()["usage"]["completion_tokens"] == 24
    monkeypatch.undo()
    assert_still_serving(base)
    assert not engine.engine.requests and engine.engine.block_manager.usage == 0.0


def test_streamed_request_gets_an_error_event_when_its_step_fails(inproc_server: tuple,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    base, engine = inproc_server
    runner = engine.engine.runner
    original = runner.run
    calls = {"n": 0}

    def flaky(batch):  # noqa: ANN001, ANN202
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected model failure")
        return original(batch)

    monkeypatch.setattr(runner, "run", flaky)
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 10, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", content=json.dumps(body), headers=HEADERS, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert "injected model failure" in err["message"] and err["type"] == "server_error"
    monkeypatch.undo()
    assert_still_serving(base)


def test_failure_outside_any_request_fails_those_in_flight_and_the_loop_goes_on(
        inproc_server: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that raises before it reaches any one request (here the scheduler) fails the requests in
    flight; the engine thread survives and serves the next request."""
    base, engine = inproc_server
    sched = engine.engine.scheduler
    original = sched.schedule
    calls = {"n": 0}

    def broken() -> object:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected scheduler failure")
        return original()

    monkeypatch.setattr(sched, "schedule", broken)
    r = post(base, "/v1/completions", {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 8, "ignore_eos": True})
    err = assert_openai_error(r, 500)
    assert "injected scheduler failure" in err["message"]
    monkeypatch.undo()
    assert engine.healthy
    assert_still_serving(base)
    assert not engine.engine.requests and engine.engine.block_manager.usage == 0.0


def test_api_key_is_compared_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    import hmac

    from torchbridge.serve.api import context

    seen = []
    real = hmac.compare_digest
    monkeypatch.setattr(context.hmac, "compare_digest", lambda a, b: seen.append(1) or real(a, b))
    assert context.key_matches("Bearer k", "k") and not context.key_matches("Bearer x", "k") and seen


# ---- fuzz ------------------------------------------------------------------------------------
_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                     st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner,
                                                                                                 max_size=3), max_leaves=6)
_small_int = st.integers(-3, 6) | st.sampled_from([2**63, 2**64, 10**12]) | _values
_FIELDS = {
    "max_tokens": _small_int, "temperature": st.floats() | _values, "top_p": st.floats() | _values,
    "top_k": _small_int, "min_p": st.floats() | _values, "n": _small_int, "seed": st.integers() | _values,
    "presence_penalty": st.floats() | _values, "frequency_penalty": st.floats() | _values,
    "repetition_penalty": st.floats() | _values, "stop": st.text(max_size=3) | st.lists(st.text(max_size=3)) | _values,
    "stop_token_ids": st.lists(st.integers(-5, 400)) | _values, "min_tokens": _small_int,
    "logit_bias": st.dictionaries(st.sampled_from(["0", "5", "319", "320", "-1", "x"]),
                                  st.floats() | st.integers(-200, 200)) | _values,
    "logprobs": _small_int, "stream": st.booleans() | _values, "ignore_eos": st.booleans() | _values,
    "model": st.sampled_from([MODEL, None, "other"]) | _values,
}
_prompt = st.text(max_size=12) | st.lists(st.integers(-2, 330), max_size=6) | _values
_message = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]) | _values,
                                  "content": st.text(max_size=12) | _values})


@st.composite
def _request(draw: st.DrawFn) -> tuple[str, dict]:
    chat = draw(st.booleans())
    body = {k: draw(v) for k, v in _FIELDS.items() if draw(st.booleans())}
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = 8  # keep a valid request cheap; huge values are covered above
    if isinstance(body.get("n"), int) and body["n"] > 3:
        body["n"] = 3
    if chat:
        body["messages"] = draw(st.lists(_message, max_size=3) | _values)
        if draw(st.booleans()):
            body["logprobs"], body["top_logprobs"] = draw(st.booleans() | _values), draw(_small_int)
    else:
        body["prompt"] = draw(_prompt)
    return ("/v1/chat/completions" if chat else "/v1/completions"), body


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(req=_request())
def test_fuzzed_requests_never_5xx(server: tuple, req: tuple[str, dict]) -> None:
    base = server[0]
    path, body = req
    raw = json.dumps(body, allow_nan=True).encode()
    r = httpx.post(base + path, content=raw, headers=HEADERS, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert set(r.json()["error"]) >= {"message", "type", "param", "code"}
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_engine_alive_after_fuzzing(server: tuple) -> None:
    assert_still_serving(server[0])
