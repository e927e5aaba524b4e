"""The worker processes of a tensor-parallel engine (`tensor_parallel_size` N > 1), as vLLM runs them.

The engine's process is rank 0 (the driver): it keeps the scheduler, the sampler and the HTTP server,
and holds the model's shard 0. It starts ranks 1..N-1 as `python -m torchbridge.serve.workers`
processes on this host, and all N join one torch.distributed process group on 127.0.0.1 (gloo for
`cpu`, torchbridge's backend for the bridge's device: XLA collectives); the model's collectives run
in it (serve/parallel.py).

Orders go to each worker over its stdin pipe, one pickled (method, args) per step, the way vLLM's
driver broadcasts scheduler output to its workers through a message queue rather than through the
accelerator's collectives: the step plan is plain data, and an idle engine has no collective waiting
on a timeout. The pipe is also the workers' lifeline: a reader thread takes the orders off it, and
when it closes (the driver stopped, crashed or was killed) the worker exits at once, even from the
middle of a collective, so no worker outlives its engine. A worker that fails exits too; the driver's
monitor thread notices, stops the others and fails every later step with the reason.
"""

from __future__ import annotations

import atexit
import logging
import os
import pickle
import queue
import signal
import socket
import subprocess
import sys
import threading
import traceback
from datetime import timedelta
from typing import Any

import torch

from torchbridge.serve.config import EngineConfig
from torchbridge.serve.parallel import TPGroup

log = logging.getLogger(__name__)

# How long collectives (and joining the group) may wait for a peer before failing: a rank that died
# or hangs makes the others fail after this, never hang forever. Steps compile inside collectives'
# reach on the bridge's device, so it is generous.
TIMEOUT = timedelta(seconds=float(os.environ.get("TORCHBRIDGE_TP_TIMEOUT", "600")))


def pick_port() -> int:
    """TORCHBRIDGE_TP_PORT, or a free port on 127.0.0.1 for the group's store."""
    if os.environ.get("TORCHBRIDGE_TP_PORT"):
        return int(os.environ["TORCHBRIDGE_TP_PORT"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_group(config: EngineConfig, rank: int, port: int, workers: WorkerGroup | None = None) -> TPGroup:
    """Join the engine's process group as `rank`; returns when every rank has joined. The driver (rank 0,
    with its `workers`) hosts the group's store and fails at once if a worker exits before joining."""
    import time

    import torch.distributed as dist

    size = config.tensor_parallel_size
    device = torch.device(config.device).type
    if dist.is_initialized():
        raise RuntimeError("--tensor-parallel-size > 1 makes the engine's own process group, but this process already "
                           "has a default torch.distributed group; start the engine in a process without one")
    if device == "cpu":
        backend = "gloo"
        # N ranks share this host's cores: give each its share, so that they do not oversubscribe them.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
    elif device == "cuda":
        backend = "nccl"
    else:
        from torchbridge.distributed import BACKEND

        backend = BACKEND
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=TIMEOUT, wait_for_workers=False)
    store.set(f"tp/joined/{rank}", "1")
    if workers is not None:
        joined = [f"tp/joined/{r}" for r in range(size)]
        while not store.check(joined):
            workers.check()
            time.sleep(0.05)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=TIMEOUT)
    return TPGroup(rank, size, dist.group.WORLD.group_name)


def leave_group() -> None:
    """Leave the engine's process group; every rank does it at the same time (on the bridge's device
    leaving JAX's distributed runtime is a barrier)."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    bridge = dist.get_backend() not in ("gloo", "nccl")
    dist.destroy_process_group()
    if bridge:
        from torchbridge.distributed import runtime

        runtime.stop()


class WorkerGroup:
    """Ranks 1..N-1, seen from the driver: start them, send them orders, stop them."""

    def __init__(self, config: EngineConfig, port: int) -> None:
        self.error: str | None = None  # why the group failed (a worker exited on its own)
        self._closing = False
        self._lock = threading.Lock()
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ)
        if torch.device(config.device).type in ("cpu", "cuda"):
            env["TORCHBRIDGE_NO_DEVICE"] = "1"  # these workers never need the bridge: skip registering it (~4 s)
        for rank in range(1, config.tensor_parallel_size):
            proc = subprocess.Popen([sys.executable, "-m", "torchbridge.serve.workers"], stdin=subprocess.PIPE, env=env)
            self.procs.append(proc)
            self._write(proc, pickle.dumps((rank, port, config)))
        atexit.register(self.close)
        for rank, proc in enumerate(self.procs, 1):
            threading.Thread(target=self._watch, args=(rank, proc), name=f"tp-worker-{rank}", daemon=True).start()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check(self) -> None:
        """Raise if the group failed (a worker exited on its own: the watcher threads notice)."""
        if self.error is not None:
            raise RuntimeError(f"tensor-parallel engine stopped: {self.error}")

    def send(self, method: str, *args: Any) -> None:
        """Every worker calls ModelRunner.<method>(*args) next (in the order sent)."""
        self.check()
        payload = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        for proc in self.procs:
            self._write(proc, payload)

    def _write(self, proc: subprocess.Popen, payload: bytes) -> None:
        try:
            proc.stdin.write(payload)  # type: ignore[union-attr]
            proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, ValueError):
            raise RuntimeError(f"tensor-parallel engine stopped: {self.error or 'a worker exited'}") from None

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self.fail(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}")

    def fail(self, reason: str) -> None:
        """The group cannot go on: remember why, stop every worker (unless it is being closed already)."""
        with self._lock:
            if self._closing:
                return
            self.error = reason
        log.error("%s; stopping the tensor-parallel workers, the engine cannot step any more", reason)
        self.close()

    def close(self, timeout: float = 10) -> None:
        """Stop the workers and leave the group. Orderly (no worker failed): every rank is told to stop and
        leaves the group with this one. Otherwise closing their pipes makes the workers exit at once.
        Workers left after `timeout` are killed."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        orderly = self.error is None
        for proc in self.procs:
            try:
                if orderly:
                    proc.stdin.write(pickle.dumps(("stop", ())))  # type: ignore[union-attr]
                proc.stdin.close()  # type: ignore[union-attr]
            except OSError:
                orderly = False
        if orderly:
            leave_group()
        for proc in self.procs:
            try:
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)


def _read_orders(stdin: Any, orders: queue.SimpleQueue) -> None:
    """Orders from the driver into the queue until "stop"; the pipe closing before that means the driver
    is gone (crashed, killed, or stopping after a failure): exit now, whatever the main thread is doing."""
    try:
        while True:
            order = pickle.load(stdin)
            orders.put(order)
            if order[0] == "stop":
                return
    except BaseException:  # noqa: BLE001 - EOF or a broken pipe alike
        os._exit(0)


def main() -> None:
    # Ctrl-C in the driver's terminal reaches the whole process group: the driver decides, and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=logging.WARNING)
    stdin = sys.stdin.buffer
    rank, port, config = pickle.load(stdin)
    orders: queue.SimpleQueue = queue.SimpleQueue()
    threading.Thread(target=_read_orders, args=(stdin, orders), name="tp-orders", daemon=True).start()
    from torchbridge.serve.model_runner import ModelRunner

    try:
        runner = ModelRunner(config, rank=rank, port=port)
        while True:
            method, args = orders.get()
            if method == "stop":
                leave_group()
                return
            getattr(runner, method)(*args)
    except BaseException:  # noqa: BLE001 - one failed rank fails the engine: say why, and go
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
