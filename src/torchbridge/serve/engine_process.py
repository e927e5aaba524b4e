"""The engine in a process of its own, the HTTP server in this one (vLLM's engine-core split).

In one interpreter the server's per-token work (request parsing, one JSON event per stream per step,
uvicorn's writes) takes the GIL from the engine's step loop: at 32 streams about 5 ms of an 11 ms
step. `EngineProcess` is the server's handle on an engine running in `engine_core` (model, scheduler,
tokenizer, detokenizer, metrics, KV events): commands go over the socket, a reader thread hands each
step's updates to the request streams (`EngineClient`), and calls (metrics, KV events) are answered
between steps. The engine process's death is seen as EOF: the streams in flight fail, new requests are
refused at once and /health says why.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing.connection
import subprocess
import threading
from typing import Any

from torchbridge.serve.async_engine import EngineClient, EngineError
from torchbridge.serve.config import EngineConfig
from torchbridge.serve.engine import InvalidRequest
from torchbridge.serve.engine_core import Launched, launch
from torchbridge.serve.sampling_params import SamplingParams
from torchbridge.serve.tokenizer import tokenizer_of

log = logging.getLogger(__name__)


class EngineProcess(EngineClient):
    """The server's handle on an engine running in a child process. `start()` returns once the engine
    is loaded (and warmed up, if asked): a model that cannot load raises here, not at the first request."""

    def __init__(self, config: EngineConfig, warmup: str = "off") -> None:
        super().__init__()
        self.config = config
        self.warmup = warmup
        # The server's own tokenizer: chat templates and logprob token strings are rendered here.
        self.tokenizer = tokenizer_of(config.model)
        self._conn: multiprocessing.connection.Connection | None = None
        self._proc: subprocess.Popen | None = None
        self._send_lock = threading.Lock()
        self._adds: dict[str, concurrent.futures.Future] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._engine_failure: str | None = None
        self._reader = threading.Thread(target=self._read, name="torchbridge-engine-reader", daemon=True)

    # ---- life cycle ------------------------------------------------------------------------------
    def start(self, wait: bool = True, launched: Launched | None = None) -> None:
        """Start the engine process (or hand the config to one `launch()`ed earlier); with wait=False return
        at once (the caller does its own start-up meanwhile) and call `wait_ready()` before serving."""
        self._proc, self._conn = launched or launch(self.config.device)
        # The server's log level, so that the engine logs alike.
        self._conn.send((self.config, self.warmup, logging.getLogger().getEffectiveLevel()))
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the engine is loaded (and warmed up); a model that cannot load raises here."""
        assert self._proc is not None and self._conn is not None, "start() first"
        try:
            kind, why = _recv_while_alive(self._conn, self._proc)
        except EOFError:
            self._proc.wait(timeout=30)
            raise RuntimeError(f"the engine process exited while starting (exit code {self._proc.returncode})") from None
        if kind != "ready":
            self._proc.wait(timeout=30)
            raise RuntimeError(f"the engine failed to start: {why}")
        self._reader.start()

    def shutdown(self) -> None:
        proc = self._proc
        if proc is None:
            return
        try:
            self._post(("stop",))
        except OSError:
            pass
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop in 30 s; killing it")
            proc.kill()
            proc.wait(timeout=10)
        if self._conn is not None:
            self._conn.close()
        if self._reader.is_alive():
            self._reader.join(timeout=5)

    def _exit_code(self) -> int | None:
        """The engine process's exit code, waiting a moment for it (its socket closes just before it exits)."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            return None

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def healthy(self) -> bool:
        return (self.error is None and self._proc is not None and self._proc.poll() is None
                and self._reader.is_alive() and self._engine_failure is None)

    @property
    def failure(self) -> str | None:
        if self.error is not None:
            return str(self.error)
        if self._proc is None or self._proc.poll() is not None:
            code = None if self._proc is None else self._proc.returncode
            return f"the engine process is not running (exit code {code})"
        return self._engine_failure

    # ---- requests and calls ---------------------------------------------------------------------
    async def compile(self, params: SamplingParams) -> None:
        """Nothing here: the engine process compiles a request's grammar on its own thread when the
        request arrives (a compiled grammar does not cross a process boundary)."""

    async def metrics_text(self) -> bytes:
        return await self._call("metrics")

    async def kv_events(self, since: int, limit: int) -> dict | None:
        return await self._call("kv_events", since, limit)

    async def _call(self, what: str, *args: object) -> Any:
        if self.error is not None:
            raise RuntimeError(f"engine failed: {self.error}")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        n = next(self._call_ids)
        self._calls[n] = fut
        try:
            self._post(("call", n, what, args))
        except OSError as e:
            self._calls.pop(n, None)
            raise RuntimeError(f"the engine process is gone: {e}") from None
        return await asyncio.wrap_future(fut)

    async def engine_state(self) -> dict:
        """What the engine holds now (requests, KV-cache usage, finished requests, its pid): for tests and
        debugging."""
        return await self._call("state")

    def _send(self, cmd: str, args: tuple, fut: concurrent.futures.Future | None) -> None:
        if self.error is not None:  # the engine is gone: refuse at once rather than write into a dead pipe
            if fut is not None:
                fut.set_exception(RuntimeError(f"engine failed: {self.error}"))
            return
        if cmd == "add":
            self._adds[args[0]] = fut  # type: ignore[assignment]
        try:
            self._post((cmd, *args))
        except OSError as e:
            if fut is not None:
                self._adds.pop(args[0], None)
                fut.set_exception(RuntimeError(f"the engine process is gone: {e}"))

    def _post(self, msg: tuple) -> None:
        if self._conn is None:
            raise OSError("the engine process is not started")
        with self._send_lock:
            self._conn.send(msg)

    def _read(self) -> None:
        conn = self._conn
        assert conn is not None
        try:
            while True:
                msg = conn.recv()
                kind = msg[0]
                if kind == "step":
                    self._deliver([(u.request_id, u) for u in msg[1]])
                elif kind == "added":
                    fut = self._adds.pop(msg[1], None)
                    if fut is not None:
                        refused = msg[2]
                        if refused is None:
                            fut.set_result(None)
                        elif refused[0] == "invalid":
                            fut.set_exception(InvalidRequest(*refused[1:]))
                        else:
                            fut.set_exception(EngineError(refused[1]))
                elif kind == "reply":
                    fut = self._calls.pop(msg[1], None)
                    if fut is not None:
                        if isinstance(msg[2], BaseException):
                            fut.set_exception(msg[2])
                        else:
                            fut.set_result(msg[2])
                elif kind == "failure":
                    self._engine_failure = msg[1]
        except (EOFError, OSError) as e:
            why = f"the engine process exited (exit code {self._exit_code()})" if isinstance(e, EOFError) else str(e)
            if self.error is None:
                self.error = RuntimeError(why)
        gone = RuntimeError(f"engine failed: {self.error}")
        for fut in [*self._adds.values(), *self._calls.values()]:
            if not fut.done():
                fut.set_exception(gone)
        self._adds.clear()
        self._calls.clear()
        self._fail_streams(str(gone))


def _recv_while_alive(conn: multiprocessing.connection.Connection, proc: subprocess.Popen) -> tuple:
    """The next message, or EOFError when the process died first (a loading engine may take minutes)."""
    while not conn.poll(1.0):
        if proc.poll() is not None:
            raise EOFError
    return conn.recv()
