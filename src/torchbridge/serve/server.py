"""OpenAI-compatible HTTP server (FastAPI) in front of the engine.

Endpoints
  GET  /health                  200 while the engine loop is alive
  GET  /metrics                 Prometheus text, vLLM metric names (see metrics.py)
  GET  /v1/models               the served model
  POST /v1/completions          text or token-id prompts; `stream`, `stream_options.include_usage`, `logprobs`
  POST /v1/chat/completions     chat template applied; `stream`, `logprobs` + `top_logprobs`
  GET  /v1/kv_events?since=N    KV-cache block events, for routers that index cached prefixes

With `api_key` set, every /v1 endpoint wants `Authorization: Bearer <key>`. Errors are OpenAI-style:
`{"error": {"message", "type", "param", "code"}}` with 400 (bad request), 401, 404 (unknown model).

KV events (`GET /v1/kv_events?since=N&limit=M`) answer
  {"events": [...], "next": <id to ask for next>, "dropped": <bool>, "block_size": B}
Each event has "id" (consecutive from 0), "type", "ts" (unix seconds) and:
  "stored":  "block_hashes": [h_i, h_i+1, ...]  consecutive full blocks of one sequence, each the
             parent of the next; "parent_block_hash": h_{i-1} or null for a sequence's first block;
  "removed": "block_hashes": [h, ...]  blocks evicted from the prefix cache;
  "cleared": the whole prefix cache was dropped.
Hashes are unsigned 64-bit ints: h_i = xxh64(le_u64(h_{i-1}) || le_i32(token ids of block i), seed 0)
with h_{-1} = 0, over the prompt's token ids as this engine tokenizes them, B tokens per block. A
router that sees "dropped": true (it fell behind the bounded log, or the server restarted) must
rebuild its index for this server from the events that follow.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from torchbridge.serve.async_engine import AsyncEngine
from torchbridge.serve.engine import InvalidRequest, SeqUpdate
from torchbridge.serve.metrics import Metrics
from torchbridge.serve.protocol import ChatCompletionRequest, CompletionRequest
from torchbridge.serve.sampling_params import SamplingParams


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def _error(status: int, message: str, type_: str, param: str | None = None, code: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code if code is not None else str(status)}}
    return JSONResponse(body, status_code=status)


def create_app(engine: AsyncEngine, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="torchbridge serve")
    eng = engine.engine
    model_name = eng.config.served_model_name or "model"
    metrics = Metrics(eng, model_name)
    tokenizer = eng.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _error(400, "the request body is not valid JSON", "invalid_request_error", None, "invalid_json")
        msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body')}: {er.get('msg')}" for er in errs)
        return _error(400, msg or "invalid request", "invalid_request_error", ".".join(loc) or None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail), "invalid_request_error" if e.status_code < 500 else "server_error")

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> JSONResponse:
        return _error(500, f"internal error: {e}", "server_error")

    def check_auth(request: Request) -> None:
        if api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model `{name}` does not exist", "invalid_request_error", "model", "model_not_found")

    async def parse(request: Request, cls: type) -> object:
        check_auth(request)
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        try:
            return cls.model_validate(body)
        except Exception as e:  # pydantic ValidationError
            errors = getattr(e, "errors", lambda: [])()
            param = ".".join(str(x) for x in errors[0]["loc"]) if errors else None
            raise APIError(400, str(e).splitlines()[0] if not errors else f"{param}: {errors[0]['msg']}", param=param) from None

    def params_of(req: CompletionRequest | ChatCompletionRequest) -> SamplingParams:
        try:
            return req.sampling_params()
        except ValueError as e:
            raise APIError(400, str(e), param=getattr(e, "param", None)) from None

    @app.get("/health")
    async def health() -> Response:
        if not engine.healthy:
            return _error(503, f"engine is not running: {engine.error}", "server_error")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        check_auth(request)
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": int(time.time()), "owned_by": "torchbridge",
            "root": eng.config.model, "max_model_len": eng.config.max_model_len,
        }]}

    @app.get("/v1/kv_events")
    async def kv_events(request: Request, since: int = 0, limit: int = 10000) -> dict:
        check_auth(request)
        if eng.kv_events is None:
            raise APIError(404, "KV events are disabled on this server", code="kv_events_disabled")
        return {**eng.kv_events.since(since, max(1, min(limit, 100000))), "block_size": eng.config.block_size}

    def token_str(t: int) -> str:
        return tokenizer.token_text(t) if tokenizer is not None else str(t)

    def completion_logprobs(lps: list[dict], text_offset: int) -> dict:
        tokens = [token_str(lp["token"]) for lp in lps]
        offsets, off = [], text_offset
        for s in tokens:
            offsets.append(off)
            off += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [lp["logprob"] for lp in lps],
            "top_logprobs": [{token_str(t): v for t, v in lp["top"]} for lp in lps],
            "text_offset": offsets,
        }

    def chat_logprobs(lps: list[dict]) -> dict:
        def entry(t: int, v: float) -> dict:
            s = token_str(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        return {"content": [
            {**entry(lp["token"], lp["logprob"]), "top_logprobs": [entry(t, v) for t, v in lp["top"]]} for lp in lps
        ]}

    async def run(
        prompt: str | list[int], params: SamplingParams, special: bool, request: Request
    ) -> AsyncIterator[SeqUpdate]:
        """The request's updates. Leaving early (an exception, a closed stream, a client that went away)
        closes engine.generate, which aborts the request and frees its blocks."""
        rid = uuid.uuid4().hex
        gen = engine.generate(rid, prompt, params, special)
        try:
            count = 0
            async for u in gen:
                yield u
                count += 1
                if count % 8 == 0 and await request.is_disconnected():
                    return
        except InvalidRequest as e:
            raise APIError(400, str(e), param=e.param) from None
        finally:
            await gen.aclose()

    async def first_or_error(gen: AsyncIterator[SeqUpdate]) -> tuple[SeqUpdate | None, AsyncIterator[SeqUpdate]]:
        """Pull the first update before the response starts, so that a refused request is still a 400."""
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            return None, gen
        return first, gen

    def usage(prompt_tokens: int, completion_tokens: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def sse(obj: dict) -> str:
        return f"data: {json.dumps(obj)}\n\n"

    # ---- /v1/completions ---------------------------------------------------------------------
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req: CompletionRequest = await parse(request, CompletionRequest)  # type: ignore[assignment]
        check_model(req.model)
        params = params_of(req)
        prompts = req.prompts()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "the prompt is empty", param="prompt")
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            if len(prompts) != 1:
                raise APIError(400, "streaming supports one prompt per request", param="prompt")
            first, gen = await first_or_error(run(prompts[0], params, True, request))
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def stream() -> AsyncIterator[str]:
                try:
                    async for chunk in completion_chunks():
                        yield chunk
                finally:
                    await gen.aclose()

            async def completion_chunks() -> AsyncIterator[str]:
                prompt_len, completion = 0, 0
                offsets = [0] * params.n
                u = first
                while u is not None:
                    prompt_len = u.seq.prompt_len
                    completion += len(u.new_token_ids)
                    choice = {"index": u.index, "text": u.new_text, "logprobs": None,
                              "finish_reason": u.finish_reason if u.finished else None,
                              "stop_reason": u.stop_reason if u.finished else None}
                    if params.logprobs is not None:
                        choice["logprobs"] = completion_logprobs(u.new_logprobs, offsets[u.index])
                        offsets[u.index] += len(u.new_text)
                    yield sse({"id": cid, "object": "text_completion", "created": created, "model": model_name,
                               "choices": [choice]})
                    u = await anext(gen, None)
                if include_usage:
                    yield sse({"id": cid, "object": "text_completion", "created": created, "model": model_name,
                               "choices": [], "usage": usage(prompt_len, completion)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        async def finals_of(prompt: str | list[int]) -> dict[int, SeqUpdate]:
            finals: dict[int, SeqUpdate] = {}
            async for u in run(prompt, params, True, request):
                if u.finished:
                    finals[u.index] = u
            return finals

        # Several prompts in one request run concurrently: the engine batches them.
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(finals_of(p)) for p in prompts]
        except* APIError as group:  # one refused prompt refuses the request (and cancels the others)
            raise group.exceptions[0] from None
        results = [t.result() for t in tasks]
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, finals in enumerate(results):
            for j in range(params.n):
                seq = finals[j].seq
                prompt_tokens += seq.prompt_len if j == 0 else 0
                completion_tokens += seq.num_output_tokens
                choices.append({
                    "index": i * params.n + j, "text": seq.text,
                    "logprobs": completion_logprobs(seq.logprobs, 0) if params.logprobs is not None else None,
                    "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason,
                })
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model_name,
                             "choices": choices, "usage": usage(prompt_tokens, completion_tokens)})

    # ---- /v1/chat/completions ----------------------------------------------------------------
    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req: ChatCompletionRequest = await parse(request, ChatCompletionRequest)  # type: ignore[assignment]
        check_model(req.model)
        params = params_of(req)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        messages = []
        for m in req.messages:
            content = m.get("content")
            if isinstance(content, list):  # content parts: keep the text ones
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            if not isinstance(m.get("role"), str) or not isinstance(content, str | None):
                raise APIError(400, "each message needs a string role and text content", param="messages")
            messages.append({**m, "content": content or ""})
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="messages")
        try:
            prompt = tokenizer.render_chat(messages, req.add_generation_prompt)
        except Exception as e:  # template errors are the client's messages not fitting the template
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        first, gen = await first_or_error(run(prompt, params, False, request))

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def stream() -> AsyncIterator[str]:
                try:
                    async for chunk in chat_chunks():
                        yield chunk
                finally:
                    await gen.aclose()

            async def chat_chunks() -> AsyncIterator[str]:
                prompt_len, completion = 0, 0
                for j in range(params.n):
                    yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                               "choices": [{"index": j, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}]})
                u = first
                while u is not None:
                    prompt_len = u.seq.prompt_len
                    completion += len(u.new_token_ids)
                    choice = {"index": u.index, "delta": {"content": u.new_text} if u.new_text else {},
                              "logprobs": chat_logprobs(u.new_logprobs) if params.logprobs is not None else None,
                              "finish_reason": u.finish_reason if u.finished else None}
                    yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                               "choices": [choice]})
                    u = await anext(gen, None)
                if include_usage:
                    yield sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                               "choices": [], "usage": usage(prompt_len, completion)})
                yield "data: [DONE]\n\n"

            return StreamingResponse(stream(), media_type="text/event-stream")

        finals: dict[int, SeqUpdate] = {}
        u = first
        while u is not None:
            if u.finished:
                finals[u.index] = u
            u = await anext(gen, None)
        choices, completion_tokens, prompt_tokens = [], 0, 0
        for j in range(params.n):
            seq = finals[j].seq
            prompt_tokens = seq.prompt_len
            completion_tokens += seq.num_output_tokens
            choices.append({
                "index": j, "message": {"role": "assistant", "content": seq.text},
                "logprobs": chat_logprobs(seq.logprobs) if params.logprobs is not None else None,
                "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason,
            })
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                             "choices": choices, "usage": usage(prompt_tokens, completion_tokens)})

    return app
