"""POST /v1/chat/completions: the chat template applied; `stream`, `logprobs` + `top_logprobs`,
structured outputs, and tool calling (`tools`, `tool_choice` none / auto / required / a named function,
`parallel_tool_calls`; calls parsed from the output by the server's tool-call parser and, streamed,
sent as `tool_calls` deltas, one per completed call)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from torchbridge.serve.api.context import ApiContext
from torchbridge.serve.api.errors import APIError, ErrorRoute
from torchbridge.serve.api.responses import LogprobFormatter, guarded_stream, sse, update_events, usage
from torchbridge.serve.engine import SeqUpdate
from torchbridge.serve.protocol import ChatCompletionRequest, NamedToolChoice
from torchbridge.serve.sampling_params import InvalidParam, SamplingParams
from torchbridge.serve.structured_output import tool_calls_decoding


def constrain_tool_calls(ctx: ApiContext, req: ChatCompletionRequest, params: SamplingParams) -> bool:
    """Set the tool-call grammar for tool_choice auto / required / named; True when the output is to be
    parsed for tool calls."""
    choice = req.effective_tool_choice
    if choice == "none":
        return False
    if not req.tools:
        raise APIError(400, f"tool_choice {choice!r} needs `tools`", param="tools")
    if choice == "auto" and not ctx.enable_auto_tool_choice:
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
                       param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in req.tools]
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names {choice.function.name!r}, which is not among the tools {names}",
                           param="tool_choice")
    if params.guided is not None:
        raise APIError(400, f"{params.guided.param} cannot be combined with tool_choice {choice!r}",  # type: ignore[attr-defined]
                       param="tool_choice")
    xchoice: Any = choice.model_dump() if isinstance(choice, NamedToolChoice) else choice
    try:
        params.guided = tool_calls_decoding(req.tool_dicts(), xchoice, req.parallel_tool_calls)
    except InvalidParam as e:
        raise APIError(400, str(e), param=e.param) from None
    return True


def router(ctx: ApiContext, fmt: LogprobFormatter) -> APIRouter:
    r = APIRouter(route_class=ErrorRoute)

    @r.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req, params = await ctx.request(request, ChatCompletionRequest)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if ctx.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="messages")
        tools = constrain_tool_calls(ctx, req, params)
        await ctx.compile(params)
        messages = [m.for_template() for m in req.messages]
        try:
            prompt = ctx.tokenizer.render_chat(messages, req.add_generation_prompt, req.tool_dicts() or None)
        except Exception as e:  # noqa: BLE001 - template errors are the client's messages not fitting the template
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), ctx.model_name
        first, gen = await ctx.first_or_error(ctx.run(prompt, params, False, request, req.explicit_max_tokens))

        def chunk(choices: list[dict], **extra: object) -> str:
            return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": choices, **extra})

        def finish_reason(reason: str | None, called: bool) -> str | None:
            return "tool_calls" if called and reason == "stop" else reason

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            parsers = [ctx.tool_parser() for _ in range(params.n)] if tools else None

            def choice_of(u: SeqUpdate) -> dict:
                delta: dict[str, Any] = {"content": u.new_text} if u.new_text else {}
                called = False
                if parsers is not None:
                    p = parsers[u.index]
                    before = len(p.calls)
                    text, calls = p.feed(u.new_text)
                    if u.finished:
                        text += p.finish()
                    delta = {"content": text} if text else {}
                    if calls:
                        delta["tool_calls"] = [{"index": before + k, **c} for k, c in enumerate(calls)]
                    called = bool(p.calls)
                return {"index": u.index, "delta": delta,
                        "logprobs": fmt.chat(u.new_logprobs) if params.logprobs is not None else None,
                        "finish_reason": finish_reason(u.finish_reason, called) if u.finished else None}

            async def events() -> AsyncIterator[str]:
                for j in range(params.n):
                    yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                async for e in update_events(first, gen, choice_of, chunk, include_usage):
                    yield e

            return StreamingResponse(guarded_stream(events(), gen.aclose), media_type="text/event-stream")

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
            message: dict[str, Any] = {"role": "assistant", "content": seq.text}
            calls: list[dict] = []
            if tools:
                message["content"], calls = ctx.tool_parser().parse(seq.text)
                if calls:
                    message["tool_calls"] = calls
            choices.append({
                "index": j, "message": message,
                "logprobs": fmt.chat(seq.logprobs) if params.logprobs is not None else None,
                "finish_reason": finish_reason(seq.finish_reason, bool(calls)), "stop_reason": seq.stop_reason,
            })
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices, "usage": usage(prompt_tokens, completion_tokens)})

    return r
