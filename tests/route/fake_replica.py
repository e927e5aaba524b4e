"""A tiny OpenAI-compatible stand-in for an engine replica, with knobs for tests.

Responses are deterministic functions of the request body (ids derive from a hash of it), so a
response fetched through the router can be compared byte-for-byte with one fetched directly.
Run standalone with `python tests/route/fake_replica.py --port N` (used by the `up` test).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

CREATED = 1_700_000_000


@dataclass
class Knobs:
    name: str = "fake"
    model: str = "fake-model"
    healthy: bool = True
    fail_status: int | None = None      # answer completions with this status (e.g. 503)
    fail_count: int | None = None       # ... only this many times (None: always)
    delay_first_s: float = 0.0          # before the response starts
    delay_token_s: float = 0.0          # between streamed chunks
    delay_metrics_s: float = 0.0        # before /metrics answers (a scrape still in flight)
    queue: float = 0.0                  # reported vllm:num_requests_waiting
    running: float | None = None        # reported vllm:num_requests_running (None: actual)
    kv_usage: float = 0.0
    num_blocks: int = 1000
    block_size: int = 16
    engine: str = "vllm"                # metric names: vllm or sglang
    kv_events: list[dict[str, Any]] | None = None  # None: /v1/kv_events is 404
    hold: threading.Event | None = None  # if given, completions wait until it is set (to pile up load)
    received: list[dict[str, Any]] = field(default_factory=list)
    active: int = 0


def _rid(body: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


def _tokens(n: int) -> list[str]:
    return [f" t{i}" for i in range(n)]


def make_app(k: Knobs) -> FastAPI:
    app = FastAPI()

    async def _gate() -> Response | None:
        while k.hold is not None and not k.hold.is_set():
            await asyncio.sleep(0.01)
        if k.delay_first_s:
            await asyncio.sleep(k.delay_first_s)
        if k.fail_status is not None and (k.fail_count is None or k.fail_count > 0):
            if k.fail_count is not None:
                k.fail_count -= 1
            return JSONResponse({"error": {"message": f"{k.name} failing", "type": "server_error"}},
                                status_code=k.fail_status)
        return None

    async def _complete(request: Request, chat: bool) -> Response:
        body = await request.json()
        k.received.append(body)
        k.active += 1
        try:
            fail = await _gate()
            if fail is not None:
                return fail
            n = int(body.get("max_tokens") or 8)
            rid = ("chatcmpl-" if chat else "cmpl-") + _rid(body)
            toks = _tokens(n)
            if body.get("stream"):
                return StreamingResponse(_stream(rid, toks, chat, body), media_type="text/event-stream",
                                         headers={"x-fake-replica": k.name})
            text = "".join(toks)
            choice: dict[str, Any] = ({"index": 0, "message": {"role": "assistant", "content": text},
                                       "finish_reason": "length"} if chat else
                                      {"index": 0, "text": text, "logprobs": None, "finish_reason": "length"})
            prompt_len = len(json.dumps(body.get("messages") or body.get("prompt") or ""))
            return JSONResponse({
                "id": rid, "object": "chat.completion" if chat else "text_completion", "created": CREATED,
                "model": body.get("model", k.model), "choices": [choice],
                "usage": {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}},
                headers={"x-fake-replica": k.name})
        finally:
            k.active -= 1

    async def _stream(rid: str, toks: list[str], chat: bool, body: dict[str, Any]):  # noqa: ANN202
        model = body.get("model", k.model)
        for i, t in enumerate(toks):
            if chat:
                delta = {"role": "assistant", "content": t} if i == 0 else {"content": t}
                obj = {"id": rid, "object": "chat.completion.chunk", "created": CREATED, "model": model,
                       "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            else:
                obj = {"id": rid, "object": "text_completion", "created": CREATED, "model": model,
                       "choices": [{"index": 0, "text": t, "logprobs": None, "finish_reason": None}]}
            yield f"data: {json.dumps(obj)}\n\n".encode()
            if k.delay_token_s:
                await asyncio.sleep(k.delay_token_s)
        last = ({"id": rid, "object": "chat.completion.chunk", "created": CREATED, "model": model,
                 "choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]} if chat else
                {"id": rid, "object": "text_completion", "created": CREATED, "model": model,
                 "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}]})
        yield f"data: {json.dumps(last)}\n\n".encode()
        yield b"data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await _complete(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await _complete(request, chat=True)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [{"id": k.model, "object": "model", "created": CREATED,
                                                          "owned_by": k.name}]})

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if k.healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        await asyncio.sleep(k.delay_metrics_s)
        running = k.active if k.running is None else k.running
        if k.engine == "sglang":
            text = (f"# TYPE sglang:num_queue_reqs gauge\nsglang:num_queue_reqs{{model_name=\"{k.model}\"}} {k.queue}\n"
                    f"# TYPE sglang:num_running_reqs gauge\nsglang:num_running_reqs{{model_name=\"{k.model}\"}} {running}\n"
                    f"# TYPE sglang:token_usage gauge\nsglang:token_usage{{model_name=\"{k.model}\"}} {k.kv_usage}\n")
        else:
            text = (
                "# HELP vllm:num_requests_waiting Requests waiting.\n# TYPE vllm:num_requests_waiting gauge\n"
                f"vllm:num_requests_waiting{{model_name=\"{k.model}\"}} {k.queue}\n"
                "# HELP vllm:num_requests_running Requests running.\n# TYPE vllm:num_requests_running gauge\n"
                f"vllm:num_requests_running{{model_name=\"{k.model}\"}} {running}\n"
                "# HELP vllm:kv_cache_usage_perc KV usage.\n# TYPE vllm:kv_cache_usage_perc gauge\n"
                f"vllm:kv_cache_usage_perc{{model_name=\"{k.model}\"}} {k.kv_usage}\n"
                "# HELP vllm:cache_config_info Cache config.\n# TYPE vllm:cache_config_info gauge\n"
                f"vllm:cache_config_info{{block_size=\"{k.block_size}\",num_gpu_blocks=\"{k.num_blocks}\"}} 1.0\n")
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/kv_events")
    async def kv_events(since: int = 0) -> Response:
        if k.kv_events is None:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        evs = [e for e in k.kv_events if e["id"] >= since]
        nxt = (evs[-1]["id"] + 1) if evs else since
        return JSONResponse({"events": evs, "next": nxt, "dropped": False})

    return app


class ServerThread:
    """uvicorn in a daemon thread on 127.0.0.1, with clean shutdown."""

    def __init__(self, app: Any, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        cfg = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", loop="asyncio",
                             http="h11", lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout: float = 20.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name", default="fake")
    ap.add_argument("--delay-first-s", type=float, default=0.0)
    ap.add_argument("--delay-token-s", type=float, default=0.0)
    a = ap.parse_args()
    knobs = Knobs(name=a.name, delay_first_s=a.delay_first_s, delay_token_s=a.delay_token_s)
    uvicorn.run(make_app(knobs), host="127.0.0.1", port=a.port, log_level="warning")
