"""`up` under load while a replica is killed with SIGKILL: requests lost and time to restore.

Starts `python -m torchbridge up --replicas R`, runs C concurrent clients for D seconds (half of them
streaming), sends SIGKILL to replica r0 at K seconds, and reports: requests sent / failed, the failure
rate, seconds from the kill until r0 is back in the router and healthy (restore time), and requests r0
served after it came back. Writes docs/benchmarks/failover.md.

    python bench/bench_serve_failover.py                       # 2 engine replicas of the bundled model
    python bench/bench_serve_failover.py --fake                # stand-in replicas (tests/route/fake_replica.py)

tests/route/test_supervise.py runs `run_failover` with stand-in replicas.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
FAKE = ROOT / "tests" / "route" / "fake_replica.py"
OUT = ROOT / "docs" / "benchmarks" / "failover.md"


def _free_port() -> int:
    from torchbridge.route.supervisor import free_port

    return free_port()


async def _client(url: str, stream: bool, until: float, max_tokens: int, log: list[dict[str, Any]]) -> None:
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0)) as c:
        i = 0
        while time.monotonic() < until:
            i += 1
            body = {"prompt": f"request {id(log)} {i} {stream}: def f(x):", "max_tokens": max_tokens,
                    "temperature": 0, "stream": stream}
            t0 = time.monotonic()
            rec: dict[str, Any] = {"t": t0, "stream": stream}
            try:
                if stream:
                    async with c.stream("POST", url + "/v1/completions", json=body) as r:
                        rec["replica"] = r.headers.get("x-torchbridge-replica")
                        text = "".join([line async for line in r.aiter_lines()])
                        rec["ok"] = r.status_code == 200 and text.rstrip().endswith("[DONE]") and '"error"' not in text
                else:
                    r = await c.post(url + "/v1/completions", json=body)
                    rec["replica"] = r.headers.get("x-torchbridge-replica")
                    rec["ok"] = r.status_code == 200 and bool(r.json().get("choices"))
            except (httpx.HTTPError, ValueError) as e:
                rec["ok"], rec["error"] = False, type(e).__name__
            rec["dt"] = time.monotonic() - t0
            log.append(rec)


def _replica_state(url: str, name: str) -> dict[str, Any] | None:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        for r in httpx.get(url + "/admin/replicas", timeout=2).json()["replicas"]:
            if r["name"] == name:
                return r
    return None


def run_failover(up_args: list[str], duration_s: float, concurrency: int, kill_at_s: float,
                 max_tokens: int = 16, start_timeout_s: float = 600.0, log_dir: str | None = None) -> dict[str, Any]:
    """Run `up` with `up_args`, load it, SIGKILL replica r0 at `kill_at_s`; return the measurements."""
    port = _free_port()
    env = {**os.environ, "TORCHBRIDGE_NO_DEVICE": "1"}
    if log_dir:
        env["TORCHBRIDGE_UP_LOGS"] = log_dir
    proc = subprocess.Popen([sys.executable, "-m", "torchbridge", "up", "--router-port", str(port), *up_args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    lines: list[str] = []
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + start_timeout_s
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C" in line or time.monotonic() > deadline:
                break
        table = [ln.split() for ln in lines if ln.startswith("engine r")]
        if len(table) < 2 or "Ctrl-C" not in lines[-1]:
            raise RuntimeError("up did not start:\n" + "".join(lines))
        victim_pid = int(table[0][3])
        log: list[dict[str, Any]] = []
        t_start = time.monotonic()
        until = t_start + duration_s
        restore: dict[str, float] = {}

        async def load() -> None:
            async def killer() -> None:
                await asyncio.sleep(kill_at_s)
                os.kill(victim_pid, signal.SIGKILL)
                restore["kill"] = time.monotonic()
                gone = False  # first the router must see it go (removed, or failing its health check)
                while time.monotonic() < until + start_timeout_s:
                    st = await asyncio.to_thread(_replica_state, url, "r0")
                    if st is None or not st["healthy"]:
                        gone = True
                        restore.setdefault("gone", time.monotonic())
                    elif gone:
                        restore["back"] = time.monotonic()
                        return
                    await asyncio.sleep(0.1)

            await asyncio.gather(killer(), *(_client(url, i % 2 == 0, until, max_tokens, log)
                                             for i in range(concurrency)))

        asyncio.run(load())
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rest, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            rest, _ = proc.communicate()
        lines.append(rest or "")
    failed = [r for r in log if not r["ok"]]
    back = restore.get("back")
    return {
        "requests": len(log), "failed": len(failed), "failure_rate": len(failed) / max(1, len(log)),
        "failed_streams": sum(r["stream"] for r in failed),
        "restore_s": (back - restore["kill"]) if back else None,
        "removed_s": (restore["gone"] - restore["kill"]) if "gone" in restore else None,
        "served_by_r0_after_restore": sum(1 for r in log if back and r["t"] > back and r.get("replica") == "r0"),
        "killed_pid": victim_pid, "up_rc": proc.returncode, "up_output": "".join(lines),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--concurrency", type=int, default=40)
    ap.add_argument("--kill-at", type=float, default=10.0)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fake", action="store_true", help="stand-in replicas instead of engines")
    ap.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    up_args = ["--replicas", str(args.replicas)]
    if args.fake:
        up_args += ["--engine-cmd", f"{sys.executable} {FAKE} --port {{port}} --delay-token-s 0.02"]
    rows = []
    for i in range(args.rounds):
        load = os.getloadavg()
        r = run_failover(up_args, args.duration, args.concurrency, args.kill_at, args.max_tokens)
        r["load"] = load
        rows.append(r)
        print(f"round {i}: {r['requests']} requests, {r['failed']} failed ({100 * r['failure_rate']:.2f}%, "
              f"{r['failed_streams']} streams), restore {r['restore_s']} s, r0 served {r['served_by_r0_after_restore']} "
              f"after; load {load[0]:.1f}", flush=True)
    if args.write:
        cmd = "python bench/bench_serve_failover.py " + " ".join(argv if argv is not None else sys.argv[1:])
        body = [
            "# `up` restoring a killed replica",
            "",
            f"`{cmd.strip()}` ({'stand-in' if args.fake else 'engine'} replicas, {args.replicas} of them; "
            f"{args.concurrency} concurrent clients, half streaming, {args.max_tokens} tokens each, "
            f"for {args.duration:.0f} s; SIGKILL to r0 at {args.kill_at:.0f} s).",
            "Restore: seconds from the kill until the router lists r0 healthy again (process restart after "
            "the 1 s backoff, model load, health check, admin re-add).",
            "",
            "| round | requests | failed | failure rate | failed streams | restore (s) | r0 requests after | load (1 min) |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for i, r in enumerate(rows):
            rs = f"{r['restore_s']:.1f}" if r["restore_s"] is not None else "not restored"
            body.append(f"| {i} | {r['requests']} | {r['failed']} | {100 * r['failure_rate']:.2f}% | "
                        f"{r['failed_streams']} | {rs} | {r['served_by_r0_after_restore']} | {r['load'][0]:.1f} |")
        OUT.write_text("\n".join(body) + "\n")
        print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
