"""POST /v1/chat/completions: the chat template applied; `stream`, `logprobs` + `top_logprobs`."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from torchbridge.serve.api.context import ApiContext
from torchbridge.serve.api.errors import APIError, ErrorRoute
from torchbridge.serve.api.responses import LogprobFormatter, guarded_stream, sse, usage
from torchbridge.serve.engine import SeqUpdate
from torchbridge.serve.protocol import ChatCompletionRequest


def router(ctx: ApiContext, fmt: LogprobFormatter) -> APIRouter:
    r = APIRouter(route_class=ErrorRoute)

    @r.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        req = await ctx.parse(request, ChatCompletionRequest)
        ctx.check_model(req.model)
        params = ctx.params_of(req)
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        if ctx.tokenizer is None:
            raise APIError(400, "this model has no tokenizer", param="messages")
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in req.messages]
        try:
            prompt = ctx.tokenizer.render_chat(messages, req.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - template errors are the client's messages not fitting the template
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None
        cid, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), ctx.model_name
        first, gen = await ctx.first_or_error(ctx.run(prompt, params, False, request, req.explicit_max_tokens))

        def chunk(choices: list[dict], **extra: object) -> str:
            return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                        "choices": choices, **extra})

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            async def events() -> AsyncIterator[str]:
                prompt_len, completion = 0, 0
                for j in range(params.n):
                    yield chunk([{"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                u = first
                while u is not None:
                    prompt_len = u.seq.prompt_len
                    completion += len(u.new_token_ids)
                    choice = {"index": u.index, "delta": {"content": u.new_text} if u.new_text else {},
                              "logprobs": fmt.chat(u.new_logprobs) if params.logprobs is not None else None,
                              "finish_reason": u.finish_reason if u.finished else None}
                    yield chunk([choice])
                    u = await anext(gen, None)
                if include_usage:
                    yield chunk([], usage=usage(prompt_len, completion))
                yield "data: [DONE]\n\n"

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
            choices.append({
                "index": j, "message": {"role": "assistant", "content": seq.text},
                "logprobs": fmt.chat(seq.logprobs) if params.logprobs is not None else None,
                "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason,
            })
        return JSONResponse({"id": cid, "object": "chat.completion", "created": created, "model": model,
                             "choices": choices, "usage": usage(prompt_tokens, completion_tokens)})

    return r
