"""Response pieces shared by the completion endpoints: usage, logprobs in OpenAI's two shapes, and
server-sent events (an error mid-stream is one `data: {"error": ...}` event, as vLLM sends it)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

from torchbridge.serve.api.errors import APIError, error_body, log
from torchbridge.serve.engine import SeqUpdate


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


async def update_events(first: SeqUpdate | None, gen: AsyncIterator[SeqUpdate], choice_of: Callable[[SeqUpdate], dict],
                        chunk: Callable[..., str], include_usage: bool) -> AsyncIterator[str]:
    """One event per engine update (its choice made by `choice_of`), the usage event if asked, [DONE]."""
    prompt_len, completion = 0, 0
    u = first
    while u is not None:
        prompt_len = u.seq.prompt_len
        completion += len(u.new_token_ids)
        yield chunk([choice_of(u)])
        u = await anext(gen, None)
    if include_usage:
        yield chunk([], usage=usage(prompt_len, completion))
    yield "data: [DONE]\n\n"


async def guarded_stream(chunks: AsyncIterator[str], close: Callable[[], object]) -> AsyncIterator[str]:
    """Relay a stream's events; a failure after the response started becomes an error event followed by
    [DONE] (the status line has gone out), and the request is closed (aborted) either way."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as e:
        yield sse(error_body(e.message, e.type, e.param, e.code, e.status))
        yield "data: [DONE]\n\n"
    except Exception as e:  # noqa: BLE001
        log.exception("stream failed")
        yield sse(error_body(f"internal error: {type(e).__name__}: {e}", "server_error", status=500))
        yield "data: [DONE]\n\n"
    finally:
        await close()  # type: ignore[misc]


class LogprobFormatter:
    def __init__(self, token_str: Callable[[int], str]) -> None:
        self.token_str = token_str

    def completion(self, lps: list[dict], text_offset: int) -> dict:
        tokens = [self.token_str(lp["token"]) for lp in lps]
        offsets, off = [], text_offset
        for s in tokens:
            offsets.append(off)
            off += len(s)
        return {
            "tokens": tokens,
            "token_logprobs": [lp["logprob"] for lp in lps],
            "top_logprobs": [{self.token_str(t): v for t, v in lp["top"]} for lp in lps],
            "text_offset": offsets,
        }

    def chat(self, lps: list[dict]) -> dict:
        def entry(t: int, v: float) -> dict:
            s = self.token_str(t)
            return {"token": s, "logprob": v, "bytes": list(s.encode())}

        return {"content": [
            {**entry(lp["token"], lp["logprob"]), "top_logprobs": [entry(t, v) for t, v in lp["top"]]} for lp in lps
        ]}
