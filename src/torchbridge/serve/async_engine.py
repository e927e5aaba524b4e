"""Drives the synchronous engine from a background thread for asyncio callers (the HTTP server).

All engine state is touched by that one thread: callers hand it commands through a queue (add, abort)
and get each step's deltas back on a per-request asyncio.Queue, so no lock is held across a model step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
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
                item = await out.get()
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
                for u in updates:
                    self._deliver(u.request_id, u)
        except BaseException as e:  # noqa: BLE001 - e.g. KeyboardInterrupt: surface to every waiting client, then stop
            log.exception("engine loop died")
            self.error = e
            for rid in list(self._streams):
                self._deliver(rid, RuntimeError(f"engine failed: {e}"))

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

    def _deliver(self, request_id: str, item: object) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            loop, q = stream
            loop.call_soon_threadsafe(q.put_nowait, item)
