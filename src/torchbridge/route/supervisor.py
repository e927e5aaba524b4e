"""`up`'s process supervisor: engine replicas that exit are restarted with backoff and taken out of /
put back into the router through its admin API; the router's own death ends `up`.

A replica's life: starting -> healthy -> (exits) down -> (backoff elapsed) starting -> ... While a
replica is down the router has it removed (its gauges dropped with it), so no request is sent there;
requests that were mid-stream on it when it died are lost, everything else is retried by the router.
The backoff doubles per consecutive failure (1 s up to 30 s) and resets once a replica has stayed
healthy for a minute.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

BACKOFF_FIRST_S = 1.0
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        # As a server binds (uvicorn sets SO_REUSEADDR): the dead process's TIME_WAIT connections do not count.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


class StopFlag:
    """SIGINT and SIGTERM set a flag that `up`'s loops poll, instead of raising KeyboardInterrupt
    wherever the main thread happens to be: raised inside Popen.poll(), between its waitpid lock's
    acquire and the try block that releases it, the lock stays held and the shutdown's wait() then
    blocks forever (seen once in CI as `up` ignoring Ctrl-C)."""

    def __init__(self) -> None:
        self.set = False
        self._old: dict[int, object] = {}

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: object) -> None:
        self.set = True


def is_healthy(url: str, timeout_s: float = 2.0) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url + "/health", timeout=timeout_s).status_code == 200
    return False


def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float, stop: StopFlag | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (stop and stop.set):
        if proc.poll() is not None:
            return False
        if is_healthy(url):
            return True
        time.sleep(0.25)
    return False


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        if p.poll() is None:
            p.kill()
            p.wait()


@dataclass
class EngineProcess:
    """One supervised replica: how to start it, and where it is in its life."""

    name: str
    host: str
    port: int
    command: Callable[[int], list[str]]  # port -> argv
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    state: str = "down"  # starting | healthy | down
    restarts: int = 0
    backoff_s: float = BACKOFF_FIRST_S
    next_start: float = 0.0
    started_at: float = 0.0
    healthy_since: float = 0.0
    in_router: bool = True  # the router was started with it
    history: list[tuple[float, str]] = field(default_factory=list)  # (monotonic time, event)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> None:
        if not port_free(self.host, self.port):  # someone took the port while it was down
            self.port = free_port(self.host)
        logf = open(self.log_path, "ab")  # noqa: SIM115 - lives as long as the child
        self.proc = subprocess.Popen(self.command(self.port), stdout=logf, stderr=subprocess.STDOUT)
        logf.close()  # the child holds its own descriptor
        self.state, self.started_at = "starting", time.monotonic()
        self.history.append((self.started_at, "started"))


class Supervisor:
    def __init__(self, engines: list[EngineProcess], router_url: str, admin_token: str | None,
                 start_timeout_s: float, log: Callable[[str], None] = print) -> None:
        self.engines = engines
        self.router_url = router_url
        self.headers = {"Authorization": f"Bearer {admin_token}"} if admin_token else {}
        self.start_timeout_s = start_timeout_s
        self.log = log

    def tick(self, now: float | None = None) -> None:
        """One pass over the replicas (called every ~0.25 s by `up`)."""
        now = time.monotonic() if now is None else now
        for e in self.engines:
            if e.state in ("starting", "healthy") and e.proc is not None and e.proc.poll() is not None:
                self._went_down(e, now, f"exited with status {e.proc.returncode}")
            elif e.state == "starting" and is_healthy(e.url, timeout_s=1.0):
                e.state, e.healthy_since = "healthy", now
                e.history.append((now, "healthy"))
                self.log(f"replica {e.name} healthy again at {e.url} (pid {e.proc.pid if e.proc else '?'})")
            elif e.state == "starting" and now - e.started_at > self.start_timeout_s:
                assert e.proc is not None
                stop_all([e.proc])
                self._went_down(e, now, f"not healthy after {self.start_timeout_s:.0f} s")
            elif e.state == "down" and now >= e.next_start:
                e.restarts += 1
                self.log(f"restarting replica {e.name} (restart {e.restarts})")
                e.start()
            # Router membership follows the state; a failed admin call is retried on the next tick.
            if e.state == "down" and e.in_router:
                e.in_router = not self._admin("DELETE", f"/admin/replicas/{e.name}", None, ok_missing=True)
            elif e.state == "healthy" and not e.in_router:
                e.in_router = self._admin("POST", "/admin/replicas", {"name": e.name, "url": e.url})
                if e.in_router:
                    e.history.append((time.monotonic(), "added to router"))
            if e.state == "healthy" and now - e.healthy_since > STABLE_AFTER_S:
                e.backoff_s = BACKOFF_FIRST_S

    def _went_down(self, e: EngineProcess, now: float, why: str) -> None:
        e.state, e.next_start = "down", now + e.backoff_s
        e.history.append((now, "down"))
        self.log(f"replica {e.name} {why}; restarting in {e.backoff_s:.0f} s")
        e.backoff_s = min(BACKOFF_MAX_S, e.backoff_s * 2)

    def _admin(self, method: str, path: str, body: dict | None, ok_missing: bool = False) -> bool:
        try:
            r = httpx.request(method, self.router_url + path, json=body, headers=self.headers, timeout=5.0)
        except httpx.HTTPError as err:
            self.log(f"router admin {method} {path} failed: {err}")
            return False
        if r.status_code < 300 or (ok_missing and r.status_code == 404):
            return True
        self.log(f"router admin {method} {path}: HTTP {r.status_code} {r.text[:200]}")
        return False

    def procs(self) -> list[subprocess.Popen[bytes]]:
        return [e.proc for e in self.engines if e.proc is not None]
