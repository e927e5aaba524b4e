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
import time
import traceback
from datetime import timedelta
from typing import Any

import torch

from torchbridge.serve.config import EngineConfig
from torchbridge.serve.parallel import FLAG, TPGroup

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


def check_placement(device: str, size: int) -> None:
    """Refuse, before any worker starts, a group that could not run: fewer chips than `size` from
    `device`'s index on, or a process that cannot make the group (it has one already; the bridge's
    device was used before, so JAX started without its distributed runtime). Ranks of a `cpu` group
    share the host's cores, any number of them."""
    if size <= 1:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise ValueError(f"{FLAG} {size} makes the engine's own process group, but this process already has a "
                         "default torch.distributed group; start the engine in a process without one")
    d = torch.device(device)
    if d.type == "cpu":
        return
    first = d.index or 0
    if d.type == "cuda":
        count = torch.cuda.device_count()
    else:
        from torchbridge.distributed import runtime

        if runtime.backend_started():
            raise ValueError(f"{FLAG} {size} on {d.type}: the device was already used in this process, so JAX "
                             "started without its distributed runtime; create the engine before any other use "
                             "of the device")
        count = _local_chips()
    if first + size > count:
        hint = (" (emulated chips: XLA_FLAGS=--xla_force_host_platform_device_count=N)"
                if d.type != "cuda" else "")
        raise ValueError(f"{FLAG} {size} needs chips {d.type}:{first}..{first + size - 1}, one per rank, but this "
                         f"host has {count}{hint}")


def _local_chips() -> int:
    """The bridge's chips on this host, counted in a child process: counting them here would start JAX's
    backend, which rank 0 must only start after joining JAX's distributed runtime (with its group)."""
    code = ("import os, jax; "
            "print(len(jax.local_devices(backend=os.environ.get('TORCHBRIDGE_PLATFORM') or None)))")
    env = {**os.environ, "TORCHBRIDGE_NO_DEVICE": "1", "TORCHBRIDGE_DISTRIBUTED": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"could not count the device's chips: {out.stderr[-2000:]}")
    return int(out.stdout.split()[-1])


def join_group(config: EngineConfig, rank: int, port: int, workers: WorkerGroup | None = None) -> TPGroup:
    """Join the engine's process group as `rank`; returns when every rank has joined. The driver (rank 0,
    with its `workers`) hosts the group's store and fails at once if a worker exits before joining."""
    import torch.distributed as dist

    size = config.tensor_parallel_size
    device = torch.device(config.device).type
    if device == "cpu":
        backend = "gloo"
        # N ranks share this host's cores: give each its share, so that they do not oversubscribe them.
        torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
    elif device == "cuda":
        backend = "nccl"
    else:
        import jax

        from torchbridge.distributed import BACKEND

        backend = BACKEND
        # JAX's runtime ends every process of a job whose peer stopped heartbeating; the engine's process
        # must outlive a dead worker, to fail the requests with the reason and stop cleanly.
        jax.config.update("jax_enable_recoverability", True)
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

    def step_failed(self, e: Exception, grace: float = 2.0) -> RuntimeError:
        """Rank 0's part of a step raised: the group cannot step again (the workers may be inside a
        collective this rank never reached). A collective that failed because a worker died names the
        worker: its watcher is given `grace` seconds to see the exit, so the error says why."""
        deadline = time.monotonic() + grace
        while self.error is None and time.monotonic() < deadline and all(p.poll() is None for p in self.procs):
            time.sleep(0.02)
        for rank, proc in enumerate(self.procs, 1):
            if proc.poll() is not None:
                self.fail(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {proc.returncode}")
        reason = f"rank 0's step failed: {type(e).__name__}: {e}"
        self.fail(reason)
        return RuntimeError(f"tensor-parallel engine stopped: {self.error or reason}")

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        self.fail(f"tensor-parallel worker rank {rank} (pid {proc.pid}) exited with code {code}")

    def fail(self, reason: str) -> None:
        """The group cannot go on: remember why, stop every worker (unless it is being closed already)."""
        with self._lock:
            if self._closing:
                return
            self.error = self.error or reason
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
