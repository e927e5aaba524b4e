"""Every failure becomes an OpenAI-style error body: `{"error": {"message", "type", "param", "code"}}`.

Unexpected exceptions in an endpoint are answered 500 by the route class itself, so the response is
complete and the keep-alive connection stays usable (Starlette's catch-all handler re-raises after
answering, and the server then drops the connection without `Connection: close`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("torchbridge.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.close = close  # answer with Connection: close (the request body was not read)


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None, status: int = 400) -> dict:
    return {"error": {"message": message, "type": type_, "param": param,
                      "code": code if code is not None else str(status)}}


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   close: bool = False) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code, status), status_code=status,
                        headers={"connection": "close"} if close else None)


def internal_error(e: BaseException) -> JSONResponse:
    return error_response(500, f"internal error: {type(e).__name__}: {e}", "server_error")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """A pydantic error list as (message, param), param being the first error's field path."""
    first = errors[0] if errors else {}
    param = ".".join(str(x) for x in first.get("loc", ()) if x != "body") or None
    msg = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body')}: {er.get('msg')}" for er in errors)
    return msg or "invalid request", param


class ErrorRoute(APIRoute):
    """An APIRoute whose handler answers unexpected exceptions with a complete 500 response."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            try:
                return await handler(request)
            except (APIError, StarletteHTTPException, RequestValidationError):
                raise
            except Exception as e:  # noqa: BLE001 - the client gets a 500; the server goes on
                log.exception("%s %s failed", request.method, request.url.path)
                return internal_error(e)

        return guarded


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return error_response(e.status, e.message, e.type, e.param, e.code, e.close)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, e: RequestValidationError) -> JSONResponse:
        errs = list(e.errors())
        if errs and errs[0].get("type") == "json_invalid":
            return error_response(400, "the request body is not valid JSON", "invalid_request_error", None,
                                  "invalid_json")
        msg, param = validation_message(errs)
        return error_response(400, msg, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return error_response(e.status_code, str(e.detail),
                              "invalid_request_error" if e.status_code < 500 else "server_error")
