"""What every endpoint shares: the engine, authentication, and reading a request body safely.

A body is read only up to `max_request_bytes` (a larger declared Content-Length is refused before any
of it is read), parsed as JSON, checked for strings that cannot be encoded (lone surrogates from a
`\\ud800` escape would fail in the tokenizer), and validated by its pydantic model.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from torchbridge.request_body import read_limited
from torchbridge.serve.api.errors import APIError, validation_message
from torchbridge.serve.async_engine import EngineClient, EngineError
from torchbridge.serve.engine import InvalidRequest, SeqUpdate
from torchbridge.serve.sampling_params import InvalidParam, SamplingParams
from torchbridge.serve.tool_parser import TOOL_CALL_PARSERS

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20

M = TypeVar("M", bound=BaseModel)


def key_matches(authorization: str, api_key: str) -> bool:
    """The Authorization header against the key, in constant time (no timing side channel)."""
    return hmac.compare_digest(authorization.encode(), f"Bearer {api_key}".encode())


def unencodable_path(body: Any) -> str | None:
    """The dotted path of the first string in a parsed JSON value that UTF-8 cannot encode, or None."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                stack.append((f"{path}.{k}" if path else str(k), x) if _encodable(k) else (path or "body", k))
        elif isinstance(v, list):
            stack.extend((f"{path}.{i}" if path else str(i), x) for i, x in enumerate(v))
    return None


def _encodable(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


class ApiContext:
    def __init__(self, engine: EngineClient, api_key: str | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tool_call_parser: str | None = None,
                 enable_auto_tool_choice: bool = False) -> None:
        if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"unknown tool-call parser {tool_call_parser!r}; known: {sorted(TOOL_CALL_PARSERS)}")
        if enable_auto_tool_choice and tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser")
        self.tool_call_parser = tool_call_parser
        self.enable_auto_tool_choice = enable_auto_tool_choice
        self.engine = engine
        self.config = engine.config
        self.model_name = engine.model_name
        self.tokenizer = engine.tokenizer
        self.api_key = api_key
        self.max_request_bytes = max_request_bytes

    # ---- checks ----------------------------------------------------------------------------
    def check_auth(self, request: Request) -> None:
        if self.api_key is not None and not key_matches(request.headers.get("authorization", ""), self.api_key):
            raise APIError(401, "invalid or missing API key", "authentication_error", code="invalid_api_key")

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model `{name}` does not exist", "invalid_request_error", "model",
                           "model_not_found")

    async def parse(self, request: Request, cls: type[M]) -> M:
        self.check_auth(request)
        raw = await read_limited(request, self.max_request_bytes)
        if raw is None:
            raise APIError(413, f"the request body is larger than {self.max_request_bytes} bytes",
                           code="request_too_large", close=True)
        try:
            body = json.loads(raw)
        except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        bad = unencodable_path(body)
        if bad is not None:
            raise APIError(400, f"{bad}: the string holds a lone UTF-16 surrogate and cannot be encoded", param=bad)
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            msg, param = validation_message(list(e.errors()))
            raise APIError(400, msg, param=param) from None

    async def request(self, request: Request, cls: type[M]) -> tuple[M, SamplingParams]:
        """A completion request read, checked (auth, model) and turned into sampling parameters."""
        req = await self.parse(request, cls)
        self.check_model(req.model)  # type: ignore[attr-defined]
        return req, self.params_of(req)

    @staticmethod
    def params_of(req: Any) -> SamplingParams:
        try:
            return req.sampling_params()
        except InvalidParam as e:
            raise APIError(400, str(e), param=e.param) from None

    async def compile(self, params: SamplingParams) -> None:
        """Compile the request's grammar off the event loop and off the engine's step loop."""
        if params.guided is None:
            return
        try:
            await self.engine.compile(params)
        except (InvalidParam, InvalidRequest) as e:
            raise APIError(400, str(e), param=e.param) from None

    def tool_parser(self) -> Any:
        return TOOL_CALL_PARSERS[self.tool_call_parser or "hermes"]()

    # ---- running a request -----------------------------------------------------------------
    async def run(self, prompt: str | list[int], params: SamplingParams, special: bool, request: Request,
                  strict_length: bool = False) -> AsyncIterator[SeqUpdate]:
        """The request's updates. Leaving early (an exception, a closed stream, a client that went away)
        closes engine.generate, which aborts the request and frees its blocks."""
        gen = self.engine.generate(uuid.uuid4().hex, prompt, params, special, strict_length)
        try:
            count = 0
            async for u in gen:
                yield u
                count += 1
                if count % 8 == 0 and await request.is_disconnected():
                    return
        except InvalidRequest as e:
            raise APIError(400, str(e), param=e.param) from None
        except EngineError as e:
            raise APIError(500, str(e), "server_error") from None
        finally:
            await gen.aclose()

    @staticmethod
    async def first_or_error(gen: AsyncIterator[SeqUpdate]) -> tuple[SeqUpdate | None, AsyncIterator[SeqUpdate]]:
        """Pull the first update before the response starts, so that a refused request is still a 400."""
        try:
            first = await gen.__anext__()
        except StopAsyncIteration:
            return None, gen
        return first, gen

    def model_card(self) -> dict:
        return {"id": self.model_name, "object": "model", "created": int(time.time()), "owned_by": "torchbridge",
                "root": self.config.model, "max_model_len": self.config.max_model_len}
