"""GET /health, /metrics, /v1/models and /v1/kv_events."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from torchbridge.serve.api.context import ApiContext
from torchbridge.serve.api.errors import APIError, ErrorRoute, error_response


def router(ctx: ApiContext) -> APIRouter:
    r = APIRouter(route_class=ErrorRoute)

    @r.get("/health")
    async def health() -> Response:
        if not ctx.engine.healthy:
            return error_response(503, f"engine is not running: {ctx.engine.failure}", "server_error")
        return Response(status_code=200)

    @r.get("/metrics")
    async def prometheus() -> Response:
        return Response(await ctx.engine.metrics_text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @r.get("/v1/models")
    async def models(request: Request) -> dict:
        ctx.check_auth(request)
        return {"object": "list", "data": [ctx.model_card()]}

    @r.get("/v1/kv_events")
    async def kv_events(request: Request, since: int = 0, limit: int = 10000) -> dict:
        ctx.check_auth(request)
        events = await ctx.engine.kv_events(since, max(1, min(limit, 100000)))
        if events is None:
            raise APIError(404, "KV events are disabled on this server", code="kv_events_disabled")
        return {**events, "block_size": ctx.config.block_size}

    return r
