"""`python -m torchbridge route` (the router) and `python -m torchbridge up` (engines + router)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

from .config import ConfigError, ReplicaSpec, RouterConfig, load_config, parse_config


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _router_config(args: argparse.Namespace) -> RouterConfig:
    cfg = load_config(args.config) if args.config else parse_config({})
    start = len(cfg.replicas)
    for i, url in enumerate(args.replica or []):
        cfg.replicas.append(ReplicaSpec(f"r{start + i}", url.rstrip("/")))
    if args.model:
        cfg.model_dir = args.model
    if args.profile:
        if args.profile not in cfg.profiles:
            raise ConfigError(f"--profile: unknown profile {args.profile!r}; known: {sorted(cfg.profiles)}")
        cfg.default_profile = args.profile
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="torchbridge route", description="cache-aware router for OpenAI-compatible replicas")
    ap.add_argument("--config", help="router YAML (see torchbridge.route.config)")
    ap.add_argument("--replica", action="append", metavar="URL", help="replica base URL (repeatable)")
    ap.add_argument("--model", help="local model dir: use its tokenizer (exact blocks, enables KV events)")
    ap.add_argument("--profile", help="default routing profile")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    try:
        cfg = _router_config(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from .proxy import create_app

    uvicorn.run(create_app(cfg), host=args.host, port=args.port, log_level=args.log_level)
    return 0


class _StopFlag:
    """SIGINT and SIGTERM set a flag that `up`'s loops poll, instead of raising KeyboardInterrupt
    wherever the main thread happens to be: raised inside Popen.poll(), between its waitpid lock's
    acquire and the try block that releases it, the lock stays held and the shutdown's wait() then
    blocks forever (seen once in CI as `up` ignoring Ctrl-C)."""

    def __init__(self) -> None:
        self.set = False
        self._old: dict[int, object] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)

    def _handle(self, signum: int, frame: object) -> None:
        self.set = True


def _wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout_s: float, stop: _StopFlag | None = None) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not (stop and stop.set):
        if proc.poll() is not None:
            return False
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return True
        time.sleep(0.25)
    return False


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
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


def up(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="torchbridge up", description="start N engine replicas and the router")
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--model", help="model dir for the engines (and the router's tokenizer)")
    ap.add_argument("--router-port", type=int, default=8000)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--config", help="router YAML; its replicas list is extended with the started engines")
    ap.add_argument("--profile", help="default routing profile")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--engine-arg", action="append", default=[], help="extra argument for each engine (repeatable)")
    ap.add_argument("--engine-cmd", help=argparse.SUPPRESS)  # tests: a stand-in engine, "{port}" is substituted
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for health")
    ap.add_argument("--exit-when-ready", action="store_true", help=argparse.SUPPRESS)  # tests / smoke checks
    args = ap.parse_args(argv)
    if args.replicas < 1:
        print("--replicas must be >= 1", file=sys.stderr)
        return 2

    procs: list[subprocess.Popen[bytes]] = []
    rows: list[tuple[str, str, int, str]] = []
    log_dir = Path(os.environ.get("TORCHBRIDGE_UP_LOGS", "/tmp/torchbridge-up"))
    log_dir.mkdir(parents=True, exist_ok=True)
    with _StopFlag() as stop:
        try:
            return _up(args, procs, rows, log_dir, stop)
        finally:
            _stop(procs)


def _up(args: argparse.Namespace, procs: list[subprocess.Popen[bytes]], rows: list[tuple[str, str, int, str]],
        log_dir: Path, stop: _StopFlag) -> int:
    urls = []
    for i in range(args.replicas):
        port = free_port(args.host)
        if args.engine_cmd:
            cmd = [a.replace("{port}", str(port)) for a in args.engine_cmd.split()]
        else:
            cmd = [sys.executable, "-m", "torchbridge", "serve", "--device", args.device, "--host", args.host,
                   "--port", str(port), *(["--model", args.model] if args.model else []), *args.engine_arg]
        logf = open(log_dir / f"engine-{i}.log", "wb")  # noqa: SIM115 - lives as long as the child
        procs.append(subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT))
        urls.append(f"http://{args.host}:{port}")
        rows.append((f"engine r{i}", urls[-1], procs[-1].pid, "starting"))
    print(f"starting {args.replicas} engine replica(s); logs in {log_dir}", flush=True)
    for i, (url, proc) in enumerate(zip(urls, procs, strict=True)):
        ok = _wait_healthy(url, proc, args.timeout, stop)
        if stop.set:
            return _shutting_down()
        rows[i] = (rows[i][0], url, proc.pid, "healthy" if ok else f"FAILED (see {log_dir}/engine-{i}.log)")
        if not ok:
            _table(rows)
            return 1
    rcmd = [sys.executable, "-m", "torchbridge", "route", "--host", args.host, "--port", str(args.router_port)]
    for url in urls:
        rcmd += ["--replica", url]
    for flag, val in (("--config", args.config), ("--model", args.model), ("--profile", args.profile)):
        if val:
            rcmd += [flag, val]
    rlog = open(log_dir / "router.log", "wb")  # noqa: SIM115
    # The router never uses the device backend; skipping it saves importing torch and jax.
    renv = {**os.environ, "TORCHBRIDGE_NO_DEVICE": "1"}
    procs.append(subprocess.Popen(rcmd, stdout=rlog, stderr=subprocess.STDOUT, env=renv))
    rurl = f"http://{args.host}:{args.router_port}"
    ok = _wait_healthy(rurl, procs[-1], 60.0, stop)
    if stop.set:
        return _shutting_down()
    rows.append(("router", rurl, procs[-1].pid, "healthy" if ok else f"FAILED (see {log_dir}/router.log)"))
    _table(rows)
    if not ok:
        return 1
    print(f"\nOpenAI endpoint: {rurl}/v1   metrics: {rurl}/metrics   replicas: {rurl}/admin/replicas\n"
          "Ctrl-C stops everything.", flush=True)
    if args.exit_when_ready:
        return 0
    while not stop.set and all(p.poll() is None for p in procs):
        time.sleep(0.5)
    if stop.set:
        return _shutting_down()
    dead = [r for r, p in zip(rows, procs, strict=True) if p.poll() is not None]
    print(f"exiting: {', '.join(r[0] for r in dead)} stopped", file=sys.stderr)
    return 1


def _shutting_down() -> int:
    print("\nshutting down", flush=True)
    return 0


def _table(rows: list[tuple[str, str, int, str]]) -> None:
    w = [max(len(str(r[i])) for r in [("ROLE", "URL", "PID", "STATUS"), *rows]) for i in range(4)]
    for r in [("ROLE", "URL", "PID", "STATUS"), *rows]:
        print("  ".join(str(v).ljust(w[i]) for i, v in enumerate(r)), flush=True)
