"""The engine process (vLLM's engine core): the engine's step loop in an interpreter of its own, driven
by the server's `engine_process.EngineProcess` over one socket pair with multiprocessing's pickled
messages:

  server -> engine   (config, warm-up mode, log level) once, then
                     ("add", request id, prompt, params, ...)  ("abort", id)  ("call", n, what, args)  ("stop",)
  engine -> server   ("ready", None) or ("failed", why) once, then
                     ("step", [updates])  ("added", id, None | ("invalid", message, param) | ("error", why))
                     ("reply", n, value)  ("failure", why | None)

`launch()` starts a fresh interpreter (`python -m torchbridge.serve.engine_core FD`): nothing of the
server's state is forked and no caller's __main__ is re-imported. It imports the engine first and then
waits for the config, so a server that launches it before building its own side loads both at once on
two cores; this module imports nothing heavy at its top for the same reason.

A step's updates travel in one message. Each update's `seq` is a `SeqView` (the fields the server reads;
text and logprobs filled on the finishing update), not the engine's Sequence, whose token list grows.
Grammars compile on a thread here (off the step loop), so a request waits for its grammar without
stalling the batch. The process ends when told to, or when the socket closes (the server died).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import multiprocessing.connection
import os
import queue
import signal
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torchbridge.serve.sampling_params import SamplingParams

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


def _view(u: Any) -> Any:  # engine.SeqUpdate
    s = u.seq
    view = (SeqView(s.prompt_len, s.num_output_tokens, s.text, s.logprobs, s.finish_reason, s.stop_reason)
            if u.finished else SeqView(s.prompt_len))
    return dataclasses.replace(u, seq=view)  # type: ignore[arg-type]


Launched = tuple[subprocess.Popen, multiprocessing.connection.Connection]


def launch(device: str) -> Launched:
    """Start an engine process that imports the engine, then waits for its config: a server that starts
    it first imports its own side meanwhile, on the other core."""
    # A fresh interpreter on this module's entry point (not multiprocessing's spawn, which would
    # re-import the caller's __main__), talking over one end of a socket pair.
    ours, theirs = socket.socketpair()
    proc = subprocess.Popen([sys.executable, "-m", "torchbridge.serve.engine_core", str(theirs.fileno())],
                            pass_fds=(theirs.fileno(),), env=engine_env(device))
    theirs.close()
    return proc, multiprocessing.connection.Connection(ours.detach())


def engine_env(device: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The engine process's environment: the server's, with torch's CPU threads one fewer than the cores
    this process may use unless the user set OMP_NUM_THREADS (the HTTP server needs a core of its own: on 2
    cores, 2 torch threads beside it served 1097-1377 tok/s where 1 served 1875-1880, bundled bf16 at 32
    streams), and without registering the bridge's device where the engine does not run on it (~4 s)."""
    env = dict(os.environ if environ is None else environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) - 1))
    if str(device).split(":")[0] in ("cpu", "cuda"):
        env["TORCHBRIDGE_NO_DEVICE"] = "1"
    return env


def main(fd: int) -> None:
    """The engine process: its settings arrive first on the connection `fd`, then the loop runs until
    the server says stop or goes away."""
    # Ctrl-C reaches the whole process group: the server decides when the engine stops (it sends "stop").
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = multiprocessing.connection.Connection(fd)
    # Imported before the config arrives: the server builds it meanwhile.
    from torchbridge.serve.engine import LLMEngine
    from torchbridge.serve.metrics import Metrics

    try:
        config, warmup, log_level = conn.recv()
    except EOFError:
        return  # the server gave up before it sent the config
    logging.basicConfig(level=log_level)
    try:
        engine = LLMEngine(config)
        if warmup != "off":
            engine.warmup(everything=warmup == "all")
        metrics = Metrics(engine, config.api_model_name)
    except Exception as e:  # noqa: BLE001 - reported to the server, which refuses to start
        log.exception("the engine failed to start")
        conn.send(("failed", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    try:
        EngineCore(engine, metrics, conn).run()
    finally:
        engine.shutdown()


class EngineCore:
    """The engine process's loop: take every waiting command, step while there is work, send the step's
    updates."""

    def __init__(self, engine: Any, metrics: Any, conn: multiprocessing.connection.Connection) -> None:
        self.engine = engine
        self.metrics = metrics
        self.conn = conn
        self.compiled: queue.SimpleQueue = queue.SimpleQueue()  # adds whose grammar is ready
        self.compiling: set[str] = set()  # request ids whose grammar is compiling
        self.dropped: set[str] = set()  # ... and were aborted meanwhile (client gone): never added
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.failure: str | None = None
        self.stopping = False

    def run(self) -> None:
        from torchbridge.serve.async_engine import step_or_fail_all

        eng = self.engine
        while not self.stopping:
            busy = eng.has_unfinished()
            # Idle: block on the pipe (briefly while grammars compile, so that their requests start soon;
            # not at all while shape buckets are left to warm, one per pass).
            timeout = 0.0 if busy or eng.warmup_pending else (0.005 if self.compiling else 1.0)
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
            if self.stopping:
                continue
            if not eng.has_unfinished():
                eng.warm_idle()
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
            if msg[1] in self.compiling:
                self.dropped.add(msg[1])
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
            refused = _refusal(lambda: self.engine.add_request(*args), "adding the request", args[0])
        self.send(("added", args[0], refused))

    def compile_then_add(self, args: tuple) -> None:
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="torchbridge-grammar")
        params: SamplingParams = args[2]

        def compile_grammar() -> None:
            params.guided = self.engine.grammars.compile(params.guided)

        def work() -> None:
            self.compiled.put((args, _refusal(compile_grammar, "compiling the constraint", args[0])))

        self.compiling.add(args[0])
        self.pool.submit(work)

    def take_compiled(self) -> None:
        while True:
            try:
                args, refused = self.compiled.get_nowait()
            except queue.Empty:
                return
            self.compiling.discard(args[0])
            if args[0] in self.dropped:
                self.dropped.discard(args[0])
            else:
                self.add(args, refused)

    def answer(self, what: str, args: tuple) -> Any:
        if what == "metrics":
            return self.metrics.render()
        if what == "kv_events":
            return self.engine.kv_events_since(*args)
        if what == "state":  # for tests and debugging: what the engine holds
            eng = self.engine
            import torch

            return {"requests": len(eng.requests), "kv_cache_usage": eng.block_manager.usage,
                    "finished_requests": eng.stats.finished_requests, "pid": os.getpid(),
                    "torch_threads": torch.get_num_threads()}
        raise ValueError(f"unknown engine call {what!r}")

    def report_failure(self) -> None:
        failure = self.engine.failure
        if failure != self.failure:
            self.failure = failure
            self.send(("failure", failure))

    def send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except OSError:  # the server is gone: nobody is left to serve
            self.stopping = True


def _refusal(work: Any, doing: str, request_id: str) -> tuple | None:
    """Run `work()`; None when it went through, else why the request is refused: ("invalid", message,
    param) for a bad request (a 400), ("error", why) for anything else (a 500; the engine goes on)."""
    from torchbridge.serve.engine import InvalidRequest
    from torchbridge.serve.sampling_params import InvalidParam

    try:
        work()
    except (InvalidRequest, InvalidParam) as e:
        return ("invalid", str(e), e.param)
    except Exception as e:  # noqa: BLE001
        log.exception("%s %s failed", doing, request_id)
        return ("error", f"{doing} failed: {type(e).__name__}: {e}")
    return None


if __name__ == "__main__":
    # Through the imported module, so that what is pickled names torchbridge.serve.engine_core, not __main__.
    from torchbridge.serve.engine_core import main as _main

    _main(int(sys.argv[1]))
