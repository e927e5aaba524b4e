"""Drives the synchronous engine from a background thread for asyncio callers (the HTTP server).

All engine state is touched by that one thread: callers hand it commands through a queue (add, abort)
and get each step's deltas back on a per-request asyncio.Queue, so no lock is held across a model step.

A step's deltas reach the event loop in one hand-off (one wake-up of the loop per step, not one per
sequence), and a consumer that fell behind gets the deltas waiting for it merged into one (vLLM's
output collector does the same): under load the server formats one event per request per pass of the
event loop instead of one per token, and the engine thread, which shares the interpreter with the
server, gets the time back.
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

from torchbridge.serve.engine import LLMEngine, SeqUpdate
from torchbridge.serve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed this request (a step that concerned it raised); others go on."""


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="torchbridge-engine", daemon=True)
        self.error: BaseException | None = None

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
        self._commands.put(("add", (request_id, prompt, params, add_special_tokens, strict_length), fut))
        self._wake.set()
        finished = 0
        try:
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
                self._commands.put(("abort", (request_id,), None))
                self._wake.set()

    def _loop(self) -> None:
        eng = self.engine
        try:
            while not self._stop.is_set():
                self._drain_commands()
                if not eng.has_unfinished():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                try:
                    updates = eng.step()
                except Exception as e:  # noqa: BLE001 - not one request's fault: fail those in flight, go on
                    log.exception("engine step failed outside any one request; failing the requests in flight")
                    updates = eng.fail_all(f"engine step failed: {type(e).__name__}: {e}")
                self._deliver([(u.request_id, u) for u in updates])
        except BaseException as e:  # noqa: BLE001 - e.g. KeyboardInterrupt: surface to every waiting client, then stop
            log.exception("engine loop died")
            self.error = e
            self._deliver([(rid, RuntimeError(f"engine failed: {e}")) for rid in list(self._streams)])

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

    def _deliver(self, items: list[tuple[str, object]]) -> None:
        """Hand (request id, delta or exception) pairs to their streams: one call per event loop."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]] = defaultdict(list)
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None:
                by_loop[stream[0]].append((stream[1], item))
        for loop, pairs in by_loop.items():
            loop.call_soon_threadsafe(_put_all, pairs)

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
