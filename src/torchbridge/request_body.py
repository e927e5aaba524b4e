"""Reading an HTTP request body with a size limit, for the engine's server and the router (no torch)."""

from __future__ import annotations

from starlette.requests import Request


async def read_limited(request: Request, limit: int) -> bytes | None:
    """The body, or None when it is larger than `limit` bytes: refused before any of it is read when its
    Content-Length says so, as soon as it passes the limit otherwise (a chunked upload). The caller
    answers 413 with `Connection: close`, since the rest of the body stays unread."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)
