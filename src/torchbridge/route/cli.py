"""`python -m torchbridge route` (the router) and `python -m torchbridge up` (engines + router)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from .config import ConfigError, ReplicaSpec, RouterConfig, load_config, parse_config
from .supervisor import EngineProcess, StopFlag, Supervisor, free_port, stop_all, wait_healthy

# Older names, imported by the Ray app, benchmarks and tests.
_wait_healthy, _stop, _StopFlag = wait_healthy, stop_all, StopFlag
__all__ = ["free_port", "main", "up"]


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
    ap.add_argument("--admin-token", default=os.environ.get("TORCHBRIDGE_ADMIN_TOKEN"),
                    help="bearer token for /admin/* (default: $TORCHBRIDGE_ADMIN_TOKEN; without one the admin "
                         "API answers only on a loopback address)")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    try:
        cfg = _router_config(args)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    import uvicorn

    from .proxy import create_app

    if args.admin_token:
        cfg.admin_token = args.admin_token
    uvicorn.run(create_app(cfg, listen_host=args.host), host=args.host, port=args.port, log_level=args.log_level)
    return 0


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
    ap.add_argument("--admin-token", default=os.environ.get("TORCHBRIDGE_ADMIN_TOKEN"),
                    help="the router's admin token (default: $TORCHBRIDGE_ADMIN_TOKEN; needed off loopback)")
    ap.add_argument("--exit-when-ready", action="store_true", help=argparse.SUPPRESS)  # tests / smoke checks
    args = ap.parse_args(argv)
    if args.replicas < 1:
        print("--replicas must be >= 1", file=sys.stderr)
        return 2

    log_dir = Path(os.environ.get("TORCHBRIDGE_UP_LOGS", "/tmp/torchbridge-up"))
    log_dir.mkdir(parents=True, exist_ok=True)
    engines: list[EngineProcess] = []
    router: list[subprocess.Popen[bytes]] = []
    with StopFlag() as stop:
        try:
            return _up(args, engines, router, log_dir, stop)
        finally:
            stop_all(router + [e.proc for e in engines if e.proc is not None])


def _engine_command(args: argparse.Namespace) -> Callable[[int], list[str]]:
    def command(port: int) -> list[str]:
        if args.engine_cmd:
            return [a.replace("{port}", str(port)) for a in args.engine_cmd.split()]
        return [sys.executable, "-m", "torchbridge", "serve", "--device", args.device, "--host", args.host,
                "--port", str(port), *(["--model", args.model] if args.model else []), *args.engine_arg]

    return command


def _up(args: argparse.Namespace, engines: list[EngineProcess], router: list[subprocess.Popen[bytes]],
        log_dir: Path, stop: StopFlag) -> int:
    command = _engine_command(args)
    for i in range(args.replicas):
        (log_dir / f"engine-{i}.log").unlink(missing_ok=True)
        e = EngineProcess(f"r{i}", args.host, free_port(args.host), command, log_dir / f"engine-{i}.log")
        e.start()
        engines.append(e)
    rows: list[tuple[str, str, int, str]] = [(f"engine {e.name}", e.url, e.proc.pid, "starting")  # type: ignore[union-attr]
                                             for e in engines]
    print(f"starting {args.replicas} engine replica(s); logs in {log_dir}", flush=True)
    for i, e in enumerate(engines):
        assert e.proc is not None
        ok = wait_healthy(e.url, e.proc, args.timeout, stop)
        if stop.set:
            return _shutting_down()
        rows[i] = (rows[i][0], e.url, e.proc.pid, "healthy" if ok else f"FAILED (see {e.log_path})")
        if not ok:
            _table(rows)
            return 1
        e.state, e.healthy_since = "healthy", time.monotonic()
    # The router is named after the engines' order (r0, r1, ...), which the supervisor's admin calls use.
    rcmd = [sys.executable, "-m", "torchbridge", "route", "--host", args.host, "--port", str(args.router_port)]
    for e in engines:
        rcmd += ["--replica", e.url]
    for flag, val in (("--config", args.config), ("--model", args.model), ("--profile", args.profile)):
        if val:
            rcmd += [flag, val]
    rlog = open(log_dir / "router.log", "wb")  # noqa: SIM115
    # The router never uses the device backend; skipping it saves importing torch and jax.
    renv = {**os.environ, "TORCHBRIDGE_NO_DEVICE": "1"}
    if args.admin_token:
        renv["TORCHBRIDGE_ADMIN_TOKEN"] = args.admin_token
    router.append(subprocess.Popen(rcmd, stdout=rlog, stderr=subprocess.STDOUT, env=renv))
    rurl = f"http://{args.host}:{args.router_port}"
    ok = wait_healthy(rurl, router[0], 60.0, stop)
    if stop.set:
        return _shutting_down()
    rows.append(("router", rurl, router[0].pid, "healthy" if ok else f"FAILED (see {log_dir}/router.log)"))
    _table(rows)
    if not ok:
        return 1
    print(f"\nOpenAI endpoint: {rurl}/v1   metrics: {rurl}/metrics   replicas: {rurl}/admin/replicas\n"
          "Ctrl-C stops everything; replicas that exit are restarted.", flush=True)
    if args.exit_when_ready:
        return 0
    supervisor = Supervisor(engines, rurl, args.admin_token, args.timeout,
                            log=lambda m: print(f"up: {m}", file=sys.stderr, flush=True))
    while not stop.set and router[0].poll() is None:
        supervisor.tick()
        time.sleep(0.25)
    if stop.set:
        return _shutting_down()
    print(f"exiting: the router stopped (status {router[0].returncode}; see {log_dir}/router.log)", file=sys.stderr)
    return 1


def _shutting_down() -> int:
    print("\nshutting down", flush=True)
    return 0


def _table(rows: list[tuple[str, str, int, str]]) -> None:
    w = [max(len(str(r[i])) for r in [("ROLE", "URL", "PID", "STATUS"), *rows]) for i in range(4)]
    for r in [("ROLE", "URL", "PID", "STATUS"), *rows]:
        print("  ".join(str(v).ljust(w[i]) for i, v in enumerate(r)), flush=True)
