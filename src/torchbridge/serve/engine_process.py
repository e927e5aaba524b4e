"""The engine in a process of its own, the HTTP server in this one (vLLM's engine-core split).

In one interpreter the server's per-token work (request parsing, one JSON event per stream per step,
uvicorn's writes) takes the GIL from the engine's step loop: at 32 streams about 5 ms of an 11 ms
step. Here the engine (model, scheduler, tokenizer, detokenizer, metrics, KV events) lives in a spawned
child process, the server keeps its own interpreter on the other core, and the two talk over one
multiprocessing pipe:

  server -> engine   ("add", request id, prompt, params, ...)  ("abort", id)  ("call", n, what, args)
                     ("stop",)
  engine -> server   ("ready", None) or ("failed", why) once, then
                     ("step", [updates])  ("added", id, None | ("invalid", message, param) | ("error", why))
                     ("reply", n, value)  ("failure", why | None)

A step's updates travel in one message. Each update's `seq` is a `SeqView` (the fields the server reads;
text and logprobs filled on the finishing update), not the engine's Sequence, whose token list grows.
Grammars compile on a thread of the engine process (off its step loop), so a request waits for its
grammar without stalling the batch. The child ends when it is told to, or when the pipe closes (the
server died); the server sees the child's death as EOF, fails the streams in flight and reports
unhealthy.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
from typing import Any

from torchbridge.serve.async_engine import EngineClient, EngineError, step_or_fail_all
from torchbridge.serve.config import EngineConfig
from torchbridge.serve.engine import InvalidRequest, SeqUpdate
from torchbridge.serve.sampling_params import InvalidParam, SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SeqView:
    """What the server reads of a sequence. `prompt_len` is always set; the rest are the final values on
    the update that finishes the sequence and empty before it."""

    prompt_len: int
    num_output_tokens: int = 0
    text: str = ""
    logprobs: list[dict] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


def _view(u: SeqUpdate) -> SeqUpdate:
    s = u.seq
    view = (SeqView(s.prompt_len, s.num_output_tokens, s.text, s.logprobs, s.finish_reason, s.stop_reason)
            if u.finished else SeqView(s.prompt_len))
    return dataclasses.replace(u, seq=view)  # type: ignore[arg-type]


class EngineProcess(EngineClient):
    """The server's handle on an engine running in a child process. `start()` returns once the engine
    is loaded (and warmed up, if asked): a model that cannot load raises here, not at the first request."""

    def __init__(self, config: EngineConfig, warmup: bool = False) -> None:
        super().__init__()
        self.config = config
        self.warmup = warmup
        from torchbridge.serve.engine import _has_tokenizer
        from torchbridge.serve.tokenizer import Tokenizer

        # The server's own tokenizer: chat templates and logprob token strings are rendered here.
        self.tokenizer = Tokenizer(config.model) if _has_tokenizer(config.model) else None
        self._conn: multiprocessing.connection.Connection | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._send_lock = threading.Lock()
        self._adds: dict[str, concurrent.futures.Future] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._call_ids = itertools.count()
        self._engine_failure: str | None = None
        self._reader = threading.Thread(target=self._read, name="torchbridge-engine-reader", daemon=True)

    # ---- life cycle ------------------------------------------------------------------------------
    def start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of this process's torch/JAX state or threads
        parent, child = ctx.Pipe()
        # Not a daemon: the engine may start tensor-parallel workers of its own.
        level = logging.getLogger().getEffectiveLevel()  # the server's, so that the engine logs alike
        self._proc = ctx.Process(target=_engine_main, args=(self.config, self.warmup, level, child),
                                 name="torchbridge-engine-core", daemon=False)
        self._proc.start()
        child.close()
        self._conn = parent
        try:
            kind, why = _recv_while_alive(parent, self._proc)
        except EOFError:
            self._proc.join(timeout=5)
            raise RuntimeError(f"the engine process exited while starting (exit code {self._proc.exitcode})") from None
        if kind != "ready":
            self._proc.join(timeout=30)
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
        proc.join(timeout=30)
        if proc.is_alive():
            log.warning("the engine process did not stop in 30 s; killing it")
            proc.kill()
            proc.join(timeout=10)
        if self._conn is not None:
            self._conn.close()
        self._reader.join(timeout=5)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def healthy(self) -> bool:
        return (self.error is None and self._proc is not None and self._proc.is_alive()
                and self._reader.is_alive() and self._engine_failure is None)

    @property
    def failure(self) -> str | None:
        if self.error is not None:
            return str(self.error)
        if self._proc is None or not self._proc.is_alive():
            code = None if self._proc is None else self._proc.exitcode
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
            code = None if self._proc is None else self._proc.exitcode
            why = f"the engine process exited (exit code {code})" if isinstance(e, EOFError) else str(e)
            if self.error is None:
                self.error = RuntimeError(why)
        gone = RuntimeError(f"engine failed: {self.error}")
        for fut in [*self._adds.values(), *self._calls.values()]:
            if not fut.done():
                fut.set_exception(gone)
        self._adds.clear()
        self._calls.clear()
        self._fail_streams(str(gone))


def _recv_while_alive(conn: multiprocessing.connection.Connection, proc: multiprocessing.process.BaseProcess,
                      ) -> tuple:
    """The next message, or EOFError when the process died first (a loading engine may take minutes)."""
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise EOFError
    return conn.recv()


# ---- the engine process --------------------------------------------------------------------------

def _engine_main(config: EngineConfig, warmup: bool, log_level: int,
                 conn: multiprocessing.connection.Connection) -> None:
    # Ctrl-C reaches the whole process group: the server decides when the engine stops (it sends "stop").
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level)
    try:
        from torchbridge.serve.engine import LLMEngine
        from torchbridge.serve.metrics import Metrics

        engine = LLMEngine(config)
        if warmup:
            n = engine.runner.warmup(config.max_num_seqs, config.max_num_batched_tokens)
            log.info("warmed up %d shape buckets", n)
        metrics = Metrics(engine, config.served_model_name or "model")
    except Exception as e:  # noqa: BLE001 - reported to the server, which refuses to start
        log.exception("the engine failed to start")
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    try:
        _EngineCore(engine, metrics, conn).run()
    finally:
        engine.shutdown()


class _EngineCore:
    """The child's loop: take every waiting command, step while there is work, send the step's updates."""

    def __init__(self, engine: Any, metrics: Any, conn: multiprocessing.connection.Connection) -> None:
        self.engine = engine
        self.metrics = metrics
        self.conn = conn
        self.compiled: queue.SimpleQueue = queue.SimpleQueue()  # adds whose grammar is ready
        self.compiling = 0
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.failure: str | None = None
        self.stopping = False

    def run(self) -> None:
        eng = self.engine
        while not self.stopping:
            busy = eng.has_unfinished()
            # Idle: block on the pipe (briefly while grammars compile, so that their requests start soon).
            timeout = 0.0 if busy else (0.005 if self.compiling else 1.0)
            try:
                if self.conn.poll(timeout):
                    while True:
                        self.handle(self.conn.recv())
                        if self.stopping or not self.conn.poll(0):
                            break
            except (EOFError, OSError):
                return  # the server is gone
            self.take_compiled()
            self.report_failure()
            if self.stopping or not eng.has_unfinished():
                continue
            updates = step_or_fail_all(eng)
            if updates:
                self.send(("step", [_view(u) for u in updates]))

    def handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "add":
            params: SamplingParams = msg[3]
            if params.guided is not None and params.guided.compiled is None:  # type: ignore[attr-defined]
                self.compile_then_add(msg[1:])
            else:
                self.add(msg[1:])
        elif kind == "abort":
            self.engine.abort_request(msg[1])
        elif kind == "call":
            _, n, what, args = msg
            try:
                value = self.answer(what, args)
            except Exception as e:  # noqa: BLE001 - the caller gets it; the engine goes on
                value = RuntimeError(f"engine call {what!r} failed: {type(e).__name__}: {e}")
            self.send(("reply", n, value))
        elif kind == "stop":
            self.stopping = True

    def add(self, args: tuple, refused: tuple | None = None) -> None:
        if refused is None:
            try:
                self.engine.add_request(*args)
            except (InvalidRequest, InvalidParam) as e:
                refused = ("invalid", str(e), e.param)
            except Exception as e:  # noqa: BLE001 - the request fails (a 500), the engine goes on
                log.exception("adding request %s failed", args[0])
                refused = ("error", f"adding the request failed: {type(e).__name__}: {e}")
        self.send(("added", args[0], refused))

    def compile_then_add(self, args: tuple) -> None:
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchbridge-grammar")
        params: SamplingParams = args[2]

        def work() -> None:
            try:
                params.guided = self.engine.grammars.compile(params.guided)
                self.compiled.put((args, None))
            except (InvalidRequest, InvalidParam) as e:
                self.compiled.put((args, ("invalid", str(e), e.param)))
            except Exception as e:  # noqa: BLE001 - the request fails (a 500), the engine goes on
                log.exception("compiling the grammar of request %s failed", args[0])
                self.compiled.put((args, ("error", f"compiling the constraint failed: {type(e).__name__}: {e}")))

        self.compiling += 1
        self.pool.submit(work)

    def take_compiled(self) -> None:
        while True:
            try:
                args, refused = self.compiled.get_nowait()
            except queue.Empty:
                return
            self.compiling -= 1
            self.add(args, refused)

    def answer(self, what: str, args: tuple) -> Any:
        if what == "metrics":
            return self.metrics.render()
        if what == "kv_events":
            log_ = self.engine.kv_events
            return None if log_ is None else log_.since(*args)
        if what == "state":  # for tests and debugging: what the engine holds
            eng = self.engine
            return {"requests": len(eng.requests), "kv_cache_usage": eng.block_manager.usage,
                    "finished_requests": eng.stats.finished_requests, "pid": os.getpid()}
        raise ValueError(f"unknown engine call {what!r}")

    def report_failure(self) -> None:
        failure = self.engine.failure
        if failure != self.failure:
            self.failure = failure
            self.send(("failure", failure))

    def send(self, msg: tuple) -> None:
        self.conn.send(msg)
