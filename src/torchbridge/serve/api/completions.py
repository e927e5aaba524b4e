"""POST /v1/completions: text or token-id prompts (several per request), `stream`,
`stream_options.include_usage`, `logprobs`, structured outputs (`response_format`, vLLM's `guided_*`)."""

from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from torchbridge.serve.api.context import ApiContext
from torchbridge.serve.api.errors import APIError, ErrorRoute
from torchbridge.serve.api.responses import LogprobFormatter, guarded_stream, sse, update_events, usage
from torchbridge.serve.engine import SeqUpdate
from torchbridge.serve.protocol import CompletionRequest


def router(ctx: ApiContext, fmt: LogprobFormatter) -> APIRouter:
    r = APIRouter(route_class=ErrorRoute)

    @r.post("/v1/completions")
    async def completions(request: Request) -> Response:
        req, params = await ctx.request(request, CompletionRequest)
        await ctx.compile(params)
        prompts = req.prompts()
        if not prompts or any(len(p) == 0 for p in prompts):
            raise APIError(400, "the prompt is empty", param="prompt")
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        model = ctx.model_name

        def chunk(choices: list[dict], **extra: object) -> str:
            return sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                        "choices": choices, **extra})

        if req.stream:
            if len(prompts) != 1:
                raise APIError(400, "streaming supports one prompt per request", param="prompt")
            first, gen = await ctx.first_or_error(ctx.run(prompts[0], params, True, request, req.explicit_max_tokens))
            include_usage = bool(req.stream_options and req.stream_options.include_usage)

            offsets = [0] * params.n

            def choice_of(u: SeqUpdate) -> dict:
                choice = {"index": u.index, "text": u.new_text, "logprobs": None,
                          "finish_reason": u.finish_reason if u.finished else None,
                          "stop_reason": u.stop_reason if u.finished else None}
                if params.logprobs is not None:
                    choice["logprobs"] = fmt.completion(u.new_logprobs, offsets[u.index])
                    offsets[u.index] += len(u.new_text)
                return choice

            events = update_events(first, gen, choice_of, chunk, include_usage)
            return StreamingResponse(guarded_stream(events, gen.aclose), media_type="text/event-stream")

        async def finals_of(prompt: str | list[int]) -> dict[int, SeqUpdate]:
            finals: dict[int, SeqUpdate] = {}
            async for u in ctx.run(prompt, params, True, request, req.explicit_max_tokens):
                if u.finished:
                    finals[u.index] = u
            return finals

        # Several prompts in one request run concurrently: the engine batches them.
        try:
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(finals_of(p)) for p in prompts]
        except* APIError as group:  # one refused prompt refuses the request (and cancels the others)
            raise group.exceptions[0] from None
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, finals in enumerate(t.result() for t in tasks):
            for j in range(params.n):
                seq = finals[j].seq
                prompt_tokens += seq.prompt_len if j == 0 else 0
                completion_tokens += seq.num_output_tokens
                choices.append({
                    "index": i * params.n + j, "text": seq.text,
                    "logprobs": fmt.completion(seq.logprobs, 0) if params.logprobs is not None else None,
                    "finish_reason": seq.finish_reason, "stop_reason": seq.stop_reason,
                })
        return JSONResponse({"id": cid, "object": "text_completion", "created": created, "model": model,
                             "choices": choices, "usage": usage(prompt_tokens, completion_tokens)})

    return r
