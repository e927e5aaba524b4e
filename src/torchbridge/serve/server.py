"""OpenAI-compatible HTTP server (FastAPI) in front of the engine.

Endpoints
  GET  /health                  200 while the engine loop is alive
  GET  /metrics                 Prometheus text, vLLM metric names (see metrics.py)
  GET  /v1/models               the served model
  POST /v1/completions          text or token-id prompts; `stream`, `stream_options.include_usage`, `logprobs`
  POST /v1/chat/completions     chat template applied; `stream`, `logprobs` + `top_logprobs`, `tools`
Both completion endpoints take structured outputs: `response_format` (json_object, json_schema with
`strict`) and vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (EBNF) or
`structured_outputs` (see structured_output.py); chat takes `tools` + `tool_choice`.
  GET  /v1/kv_events?since=N    KV-cache block events, for routers that index cached prefixes

With `api_key` set, every /v1 endpoint wants `Authorization: Bearer <key>`. Errors are OpenAI-style:
`{"error": {"message", "type", "param", "code"}}` with 400 (bad request), 401, 404 (unknown model),
413 (body over `max_request_bytes`, answered before reading it, with `Connection: close`) and 500 (a
failure inside the engine step that carried the request; the engine and other requests go on). A
streamed request that fails after its first event ends with `data: {"error": ...}` and `data: [DONE]`.
The endpoints live in torchbridge.serve.api, one module per group.

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

from fastapi import FastAPI

from torchbridge.serve.api import chat, completions, errors, status
from torchbridge.serve.api.context import DEFAULT_MAX_REQUEST_BYTES, ApiContext
from torchbridge.serve.api.errors import APIError
from torchbridge.serve.api.responses import LogprobFormatter
from torchbridge.serve.async_engine import EngineClient

__all__ = ["APIError", "create_app"]


def create_app(engine: EngineClient, api_key: str | None = None, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
               tool_call_parser: str | None = None, enable_auto_tool_choice: bool = False) -> FastAPI:
    app = FastAPI(title="torchbridge serve")
    ctx = ApiContext(engine, api_key, max_request_bytes, tool_call_parser, enable_auto_tool_choice)
    tok = ctx.tokenizer
    fmt = LogprobFormatter(tok.token_text if tok is not None else str)
    errors.install(app)
    app.include_router(status.router(ctx))
    app.include_router(completions.router(ctx, fmt))
    app.include_router(chat.router(ctx, fmt))
    app.state.context = ctx
    return app
