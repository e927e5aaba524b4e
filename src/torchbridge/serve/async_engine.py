"""What the HTTP server drives: an engine client with per-request asyncio streams.

`EngineClient` holds what both ways of running the engine share: `generate()` (a request's updates on
an asyncio.Queue of its own), the hand-off of a step's deltas to the event loop, and the merging of
deltas a slow consumer fell behind on. Subclasses say how commands reach the engine:

- `AsyncEngine` (here) drives the synchronous engine from a background thread of this process. All
  engine state is touched by that one thread; callers hand it commands through a queue (add, abort),
  so no lock is held across a model step. Used by tests and by `LLM`-style embedding.
- `engine_process.EngineProcess` runs the engine in a child process (vLLM's engine-core split): what
  `serve` uses, so that the HTTP side does not take the engine's interpreter.

A step's deltas reach the event loop in one hand-off (one wake-up of the loop per step, not one per
sequence), and a consumer that fell behind gets the deltas waiting for it merged into one (vLLM's
output collector does the same): under load the server formats one event per request per pass of the
event loop instead of one per token.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import queue
import threading
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

from torchbridge.serve.config import EngineConfig
from torchbridge.serve.engine import LLMEngine, SeqUpdate
from torchbridge.serve.metrics import Metrics
from torchbridge.serve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed this request (a step that concerned it raised); others go on."""


class EngineClient:
    """The server's view of an engine. Subclasses set `config` and `tokenizer` and implement `_send`
    (hand a command to the engine; "add" resolves its future when the engine took or refused the
    request), `healthy`, `failure`, `compile`, `metrics_text` and `kv_events`."""

    config: EngineConfig
    tokenizer: Any  # tokenizer.Tokenizer, or None for a model without one

    def __init__(self) -> None:
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.error: BaseException | None = None

    @property
    def model_name(self) -> str:
        return self.config.api_model_name

    # ---- what subclasses provide ---------------------------------------------------------------
    def _send(self, cmd: str, args: tuple, fut: concurrent.futures.Future | None) -> None:
        raise NotImplementedError

    @property
    def healthy(self) -> bool:
        raise NotImplementedError

    @property
    def failure(self) -> str | None:
        """Why the engine is not healthy (None while it is)."""
        raise NotImplementedError

    async def compile(self, params: SamplingParams) -> None:
        """Compile the request's grammar before it is added (off the engine's step loop); an invalid one
        raises InvalidParam or InvalidRequest."""
        raise NotImplementedError

    async def metrics_text(self) -> bytes:
        """The Prometheus exposition of the engine's metrics (vLLM's names)."""
        raise NotImplementedError

    async def kv_events(self, since: int, limit: int) -> dict | None:
        """KV-cache events from id `since` (kv_events.KVEventLog.since), or None when they are off."""
        raise NotImplementedError

    # ---- requests --------------------------------------------------------------------------------
    async def generate(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, add_special_tokens: bool = True,
        strict_length: bool = False,
    ) -> AsyncIterator[SeqUpdate]:
        """Yield the request's per-step updates until every choice finished. Raises InvalidRequest for a
        request the engine refuses and EngineError for one that failed inside a step. If the consumer
        stops early (client gone) the request is aborted."""
        loop = asyncio.get_running_loop()
        out: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (loop, out)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        finished = 0
        try:
            self._send("add", (request_id, prompt, params, add_special_tokens, strict_length), fut)
            await asyncio.wrap_future(fut)
            while finished < params.n:
                for item in _merged([await out.get(), *_waiting(out)]):
                    if isinstance(item, BaseException):
                        raise item
                    if item.error is not None:
                        raise EngineError(item.error)
                    finished += item.finished
                    yield item
        finally:
            self._streams.pop(request_id, None)
            if finished < params.n:
                self._send("abort", (request_id,), None)

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """Hand (request id, delta or exception) pairs to their streams: one call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = defaultdict(list)
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop[stream[0]].append((stream[1], item))
        for loop, pairs in by_loop.items():
            loop.call_soon_threadsafe(_put_all, pairs)

    def _fail_streams(self, message: str) -> None:
        """The engine is gone: every waiting client gets the error."""
        self._deliver([(rid, RuntimeError(message)) for rid in list(self._streams)])


class AsyncEngine(EngineClient):
    """The engine stepped by a thread of this process."""

    def __init__(self, engine: LLMEngine) -> None:
        super().__init__()
        self.engine = engine
        self.config = engine.config
        self.tokenizer = engine.tokenizer
        self.metrics = Metrics(engine, self.model_name)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="torchbridge-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)
        self.engine.shutdown()

    @property
    def healthy(self) -> bool:
        return self.error is None and self._thread.is_alive() and self.engine.failure is None

    @property
    def failure(self) -> str | None:
        if self.error is not None:
            return str(self.error)
        if not self._thread.is_alive():
            return "the engine thread is not running"
        return self.engine.failure

    async def compile(self, params: SamplingParams) -> None:
        if params.guided is not None:
            grammars = self.engine.grammars
            params.guided = await asyncio.to_thread(grammars.compile, params.guided)  # type: ignore[arg-type]

    async def metrics_text(self) -> bytes:
        return self.metrics.render()

    async def kv_events(self, since: int, limit: int) -> dict | None:
        return self.engine.kv_events_since(since, limit)

    def _send(self, cmd: str, args: tuple, fut: concurrent.futures.Future | None) -> None:
        self._commands.put((cmd, args, fut))
        self._wake.set()

    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not eng.has_unfinished():
                    if eng.warmup_pending:  # one shape bucket left to warm per idle pass
                        eng.warm_idle()
                        continue
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                updates = step_or_fail_all(eng)
                self._deliver([(u.request_id, u) for u in updates])
        except BaseException as e:  # noqa: BLE001 - e.g. KeyboardInterrupt: surface to every waiting client, then stop
            log.exception("engine loop died")
            self.error = e
            self._fail_streams(f"engine failed: {e}")

    def _drain_commands(self) -> None:
        while True:
            try:
                cmd, args, fut = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd == "add":
                try:
                    self.engine.add_request(*args)
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
                else:
                    fut.set_result(None)
            elif cmd == "abort":
                self.engine.abort_request(*args)


def step_or_fail_all(engine: LLMEngine) -> list[SeqUpdate]:
    """One engine step. A failure the engine did not pin on one request (the scheduler's, say) fails the
    requests in flight; the loop that called this goes on."""
    try:
        return engine.step()
    except Exception as e:  # noqa: BLE001 - not one request's fault: fail those in flight, go on
        log.exception("engine step failed outside any one request; failing the requests in flight")
        return engine.fail_all(f"engine step failed: {type(e).__name__}: {e}")


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)


def _waiting(q: asyncio.Queue) -> list[object]:
    items = []
    while not q.empty():
        items.append(q.get_nowait())
    return items


def _merged(items: list[object]) -> list[object]:
    """Consecutive deltas of the same choice as one (text, token ids and logprobs joined; the later one's
    state). An error, an exception or a finished delta closes the run."""
    out: list[object] = []
    for item in items:
        last = out[-1] if out else None
        if (isinstance(item, SeqUpdate) and isinstance(last, SeqUpdate) and last.index == item.index
                and not last.finished and last.error is None and item.error is None):
            out[-1] = dataclasses.replace(
                item, new_token_ids=last.new_token_ids + item.new_token_ids, new_text=last.new_text + item.new_text,
                new_logprobs=last.new_logprobs + item.new_logprobs)
        else:
            out.append(item)
    return out
