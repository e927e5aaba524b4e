"""The OpenAI-compatible proxy: flow control, picking, retry-before-first-byte, passthrough.

A request is committed to a replica only once that replica has produced its first response
bytes; until then any transport error or 5xx sends it to another replica (the client sees
nothing), so a replica dying before it answers loses no request. Bytes are relayed unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from torchbridge.request_body import read_limited

from .config import RouterConfig, build_profile, load_config
from .metrics import RouterMetrics
from .picker import Decision, EndpointPicker, NoReplicaError
from .prompt_tokens import Tokenizer, make_tokenizer, request_tokens
from .replicas import ReplicaPool

log = logging.getLogger("torchbridge.route")

REPLICA_HEADER = "x-torchbridge-replica"
_FORWARD_HEADERS = ("content-type", "authorization", "x-request-id", "openai-organization", "accept")
_HOP_BY_HOP = {"content-length", "content-encoding", "transfer-encoding", "connection", "keep-alive", "date",
               "server"}


def openai_error(status: int, message: str, typ: str, code: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": typ, "param": None, "code": code}},
                        status_code=status)


class QueueFull(Exception):
    pass


class FlowControl:
    """At most `max_inflight` requests proxied at once; up to `max_queue` more wait (FIFO, as
    asyncio.Semaphore wakes waiters in order); beyond that, refuse immediately with 429 rather
    than let latency grow without bound."""

    def __init__(self, max_inflight: int, max_queue: int, timeout_s: float) -> None:
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.timeout_s = timeout_s
        self._sem = asyncio.Semaphore(max_inflight)
        self.waiting = 0
        self.inflight = 0

    async def acquire(self) -> None:
        if self._sem.locked() or self.waiting:
            if self.waiting >= self.max_queue:
                raise QueueFull
            self.waiting += 1
            try:
                await asyncio.wait_for(self._sem.acquire(), self.timeout_s)
            except TimeoutError as e:
                raise QueueFull from e
            finally:
                self.waiting -= 1
        else:
            await self._sem.acquire()
        self.inflight += 1

    def release(self) -> None:
        self.inflight -= 1
        self._sem.release()


class _FlowSlot:
    """One admitted request's place in FlowControl, given back exactly once: by the proxy, or by the
    stream it handed the response to."""

    def __init__(self, flow: FlowControl) -> None:
        self.flow = flow
        self.handed_off = False  # a StreamingResponse owns the slot and releases it when done
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self.flow.release()


class _Started(NamedTuple):
    """A replica that has started answering: its response, the rest of its bytes, the first ones."""

    upstream: httpx.Response
    chunks: AsyncIterator[bytes]
    first: bytes


class _Failure(NamedTuple):
    """Why an attempt produced no response bytes; a 5xx keeps (status, body, headers) to pass on."""

    error: str
    response: tuple[int, bytes, dict[str, str]] | None = None


class Router:
    """State of one router process (what the FastAPI app closes over)."""

    def __init__(self, cfg: RouterConfig, tokenizer: Tokenizer | None = None, seed: int | None = None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer or make_tokenizer(cfg.model_dir, cfg.chars_per_token)
        self.picker = EndpointPicker(cfg, seed=seed)
        self.picker.tokenizer_exact = self.tokenizer.exact
        self.metrics = RouterMetrics()
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(cfg.request_timeout_s, connect=cfg.connect_timeout_s),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
        self.pool = ReplicaPool(cfg, self.picker, self.metrics, self.client)
        self.flow: FlowControl | None = None  # created inside the event loop
        for spec in cfg.replicas:
            self.pool.add(spec.name, spec.url)

    async def start(self) -> None:
        self.flow = FlowControl(self.cfg.max_inflight, self.cfg.max_queue, self.cfg.queue_timeout_s)
        await self.pool.start()
        for rep in list(self.pool.replicas.values()):
            await self.pool.check_health(rep)
            await self.pool.scrape(rep)

    async def stop(self) -> None:
        await self.pool.stop()
        await self.client.aclose()

    def reload(self) -> dict[str, Any]:
        """Re-read the config file: replica set and profiles (other settings need a restart)."""
        if not self.cfg.source:
            raise ValueError("router was not started from a config file")
        new = load_config(self.cfg.source)
        added, removed = [], []
        wanted = {r.name: r.url for r in new.replicas}
        for name, rep in list(self.pool.replicas.items()):
            if wanted.get(name) != rep.url:
                self.pool.remove(name)
                removed.append(name)
        for name, url in wanted.items():
            if name not in self.pool.replicas:
                self.pool.add(name, url)
                added.append(name)
        self.picker.profiles = {n: build_profile(n, s) for n, s in new.profiles.items()}
        self.cfg.profiles = new.profiles
        self.cfg.default_profile = new.default_profile
        return {"added": added, "removed": removed, "profiles": sorted(new.profiles)}

    def _record_decision(self, d: Decision) -> None:
        m = self.metrics
        m.decisions.labels(d.replica, d.profile).inc()
        m.decision_latency.observe(d.latency_s)
        m.prefix_blocks.inc(d.n_blocks)
        m.prefix_hit_blocks.inc(d.hit_blocks)

    def refresh_gauges(self) -> None:
        self.metrics.hit_ratio.set(self.picker.hit_ratio())
        pool = self.picker.pool
        for name, slot in pool.slots.items():
            self.metrics.r_inflight.labels(name).set(pool.inflight[slot])
            self.metrics.r_pending.labels(name).set(pool.pending_tokens[slot])
        if self.flow is not None:
            self.metrics.queue_depth.set(self.flow.waiting)
            self.metrics.inflight.set(self.flow.inflight)

    async def proxy(self, request: Request, path: str) -> Response:
        """Admit the request, then send it to picked replicas until one starts answering."""
        parsed = await self._read_body(request)
        if isinstance(parsed, Response):
            return parsed
        raw, body = parsed
        session = request.headers.get(self.cfg.session_header)
        profile = request.headers.get(self.cfg.profile_header)
        if profile is not None and profile not in self.picker.profiles:
            return self._final(openai_error(400, f"unknown routing profile {profile!r}; known: "
                                            f"{sorted(self.picker.profiles)}", "invalid_request_error"))
        ctx = self.picker.request(request_tokens(self.tokenizer, body), session)
        assert self.flow is not None
        try:
            await self.flow.acquire()
        except QueueFull:
            self.metrics.rejected.inc()
            return self._final(openai_error(
                429, f"router queue is full ({self.flow.max_queue} waiting, {self.flow.max_inflight} in flight); "
                     "retry later", "rate_limit_exceeded", "router_queue_full"))
        slot = _FlowSlot(self.flow)
        try:
            return await self._forward(request, path, raw, ctx, session, profile, bool(body.get("stream")), slot)
        finally:
            if not slot.handed_off:
                slot.release()

    async def _read_body(self, request: Request) -> tuple[bytes, dict] | Response:
        """The raw body and its JSON object, or the error response (413 before reading past the limit, 400)."""
        raw = await read_limited(request, self.cfg.max_request_bytes)
        if raw is None:
            resp = openai_error(413, f"the request body is larger than {self.cfg.max_request_bytes} bytes",
                                "invalid_request_error", "request_too_large")
            resp.headers["connection"] = "close"  # the rest of the body was not read
            return self._final(resp)
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
        except ValueError as e:
            return self._final(openai_error(400, f"invalid JSON body: {e}", "invalid_request_error"))
        return raw, body

    async def _forward(self, request: Request, path: str, raw: bytes, ctx: Any, session: str | None,
                       profile: str | None, stream: bool, slot: _FlowSlot) -> Response:
        """Up to 1 + retries picks; the first replica that produces response bytes gets the request."""
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        headers["accept-encoding"] = "identity"  # relay bytes exactly as produced
        tried: list[str] = []
        last = _Failure("no healthy replica available")
        t_start = time.perf_counter()
        for _attempt in range(self.cfg.retries + 1):
            try:
                d = self.picker.pick(ctx, profile, exclude=tried)
            except NoReplicaError:
                break
            self._record_decision(d)
            self.picker.on_dispatch(d, session)
            rep = self.pool.get(d.replica)
            if rep is None:  # removed between pick and now
                self.picker.on_finish(d, ok=False)
                tried.append(d.replica)
                continue
            started = await self._start(rep.url + path, raw, headers, d, tried)
            if isinstance(started, _Failure):
                last = _Failure(started.error, started.response or last.response)
                continue
            # Committed: the client gets this replica's answer, whatever happens next.
            self.picker.on_first_token(d)
            self.metrics.ttft.observe(time.perf_counter() - t_start)
            return await self._answer(d, started, stream, slot)
        if last.response is not None and len(tried) > self.cfg.retries:
            status, content, hdrs = last.response
            return self._final(Response(content, status_code=status,
                                        media_type=hdrs.get("content-type", "application/json")))
        return self._final(openai_error(503, f"no replica could serve the request ({last.error}; "
                                             f"tried {tried or 'none'})", "service_unavailable"))

    async def _start(self, url: str, raw: bytes, headers: dict[str, str], d: Decision,
                     tried: list[str]) -> _Started | _Failure:
        """Send the request and wait for the first response bytes; a failure before them (transport
        error, 5xx) is recorded against the replica and leaves the request free to go elsewhere."""
        try:
            upstream = await self.client.send(self.client.build_request("POST", url, content=raw, headers=headers),
                                              stream=True)
        except httpx.HTTPError as e:
            self._failed(d, tried, f"{type(e).__name__}: {e}", passive=True)
            return _Failure(f"replica {d.replica}: {type(e).__name__}")
        if upstream.status_code >= 500:
            content = await upstream.aread()
            await upstream.aclose()
            self._failed(d, tried, f"HTTP {upstream.status_code}", passive=False)
            return _Failure(f"replica {d.replica}: HTTP {upstream.status_code}",
                            (upstream.status_code, content, dict(upstream.headers)))
        chunks = upstream.aiter_raw()
        try:
            first = await chunks.__anext__()
        except StopAsyncIteration:
            first = b""
        except httpx.HTTPError as e:
            await upstream.aclose()
            self._failed(d, tried, f"{type(e).__name__}: {e}", passive=True)
            return _Failure(f"replica {d.replica}: {type(e).__name__} before first byte")
        return _Started(upstream, chunks, first)

    async def _answer(self, d: Decision, started: _Started, stream: bool, slot: _FlowSlot) -> Response:
        """The committed replica's answer: relayed as a stream (the stream then owns the flow slot), or
        read whole (a break-off after the first bytes is a 502: nothing can be retried by then)."""
        upstream, chunks, first = started
        out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
        out_headers[REPLICA_HEADER] = d.replica
        if stream and upstream.headers.get("content-type", "").startswith("text/event-stream"):
            self.metrics.requests.labels(str(upstream.status_code)).inc()
            slot.handed_off = True
            return StreamingResponse(self._relay(first, chunks, upstream, d, slot.release),
                                     status_code=upstream.status_code, headers=out_headers)
        try:
            rest = b"".join([c async for c in chunks])
            ok = True
        except httpx.HTTPError:
            rest, ok = b"", False
        finally:
            await upstream.aclose()
        self.picker.on_finish(d, ok=True)
        slot.release()
        if not ok:
            return self._final(openai_error(502, f"replica {d.replica} broke off its response", "upstream_error"))
        return self._final(Response(first + rest, status_code=upstream.status_code, headers=out_headers))

    async def _relay(self, first: bytes, chunks: AsyncIterator[bytes], upstream: httpx.Response, d: Decision,
                     release: Any) -> AsyncIterator[bytes]:
        ok = True
        try:
            if first:
                yield first
            async for c in chunks:
                yield c
        except httpx.HTTPError:
            ok = False  # mid-stream failure: nothing to retry once the client has bytes
        finally:
            await upstream.aclose()
            self.picker.on_finish(d, ok=ok)
            release()

    def _failed(self, d: Decision, tried: list[str], err: str, passive: bool) -> None:
        log.warning("replica %s failed before responding (%s); retrying elsewhere", d.replica, err)
        self.picker.on_finish(d, ok=False)
        tried.append(d.replica)
        self.metrics.retries.labels(d.replica).inc()
        if passive:
            self.pool.mark_failed(d.replica, err)

    def _final(self, resp: Response) -> Response:
        self.metrics.requests.labels(str(resp.status_code)).inc()
        return resp


def _loopback(host: str | None) -> bool:
    if host in ("localhost", "testclient"):  # testclient: Starlette's in-process test client
        return True
    try:
        return host is not None and ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class AdminGuard:
    """/admin/* wants `Authorization: Bearer <admin token>` (compared in constant time). Without a token
    configured, the admin API answers only when the router listens on a loopback address and the
    caller is local; anywhere else it is off (403)."""

    def __init__(self, token: str | None, listen_host: str) -> None:
        self.token = token
        self.open_locally = token is None and _loopback(listen_host)

    def refusal(self, request: Request) -> Response | None:
        if self.token is not None:
            given = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):
                return openai_error(401, "invalid or missing admin token", "authentication_error", "invalid_admin_token")
            return None
        if self.open_locally and _loopback(request.client.host if request.client else None):
            return None
        return openai_error(403, "the admin API needs an admin token when the router is not on loopback "
                                 "(--admin-token, TORCHBRIDGE_ADMIN_TOKEN or router.admin_token)",
                            "permission_error", "admin_disabled")


def create_app(cfg: RouterConfig, tokenizer: Tokenizer | None = None, seed: int | None = None,
               listen_host: str = "127.0.0.1") -> FastAPI:
    router = Router(cfg, tokenizer, seed)
    guard = AdminGuard(cfg.admin_token, listen_host)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="torchbridge router", lifespan=lifespan)
    app.state.router = router

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await router.proxy(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await router.proxy(request, "/v1/chat/completions")

    @app.get("/v1/models")
    async def models() -> Response:
        seen: dict[str, Any] = {}
        for rep in list(router.pool.replicas.values()):
            if not rep.healthy:
                continue
            with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, TypeError):
                r = await router.client.get(rep.url + "/v1/models", timeout=router.cfg.timeout_s)
                for m in r.json()["data"]:
                    seen.setdefault(m["id"], m)
        return JSONResponse({"object": "list", "data": list(seen.values())})

    @app.get("/health")
    async def health() -> Response:
        healthy = [r.name for r in router.pool.replicas.values() if r.healthy]
        return JSONResponse({"status": "ok" if healthy else "no healthy replica", "healthy": healthy},
                            status_code=200 if healthy else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        router.refresh_gauges()
        return Response(generate_latest(router.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.middleware("http")
    async def admin_only_with_token(request: Request, call_next: Any) -> Response:
        if request.url.path.startswith("/admin"):
            refused = guard.refusal(request)
            if refused is not None:
                return refused
        return await call_next(request)

    @app.get("/admin/replicas")
    async def list_replicas() -> Response:
        pool = router.picker.pool
        out = []
        for rep in router.pool.replicas.values():
            slot = pool.slots[rep.name]
            out.append({**rep.describe(), "inflight": float(pool.inflight[slot]),
                        "pending_tokens": float(pool.pending_tokens[slot]),
                        "approx_blocks": router.picker.approx.size(slot),
                        "approx_capacity": router.picker.approx.capacity(slot)})
        return JSONResponse({"replicas": out, "default_profile": router.cfg.default_profile,
                             "profiles": sorted(router.picker.profiles)})

    @app.post("/admin/replicas")
    async def add_replica(request: Request) -> Response:
        try:
            spec = await request.json()
            url = str(spec["url"]).rstrip("/")
            if not url.startswith(("http://", "https://")):
                raise ValueError("url must start with http:// or https://")
            name = str(spec.get("name") or f"r{len(router.pool.replicas)}-{int(time.time() * 1000) % 100000}")
            router.pool.add(name, url)
        except (ValueError, KeyError, TypeError) as e:
            return openai_error(400, f"bad replica spec: {e}", "invalid_request_error")
        return JSONResponse({"added": name, "url": url}, status_code=201)

    @app.delete("/admin/replicas/{name}")
    async def remove_replica(name: str) -> Response:
        if name not in router.pool.replicas:
            return openai_error(404, f"no replica named {name!r}", "not_found_error")
        router.pool.remove(name)
        return JSONResponse({"removed": name})

    @app.post("/admin/reload")
    async def reload() -> Response:
        try:
            return JSONResponse(router.reload())
        except ValueError as e:  # includes ConfigError
            return openai_error(400, str(e), "invalid_request_error")

    return app
