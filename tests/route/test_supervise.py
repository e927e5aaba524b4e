"""`up` supervises: a replica killed with SIGKILL under load is restarted and put back in the router;
fewer than 2% of requests fail (only streams that were mid-generation on it), and it serves again."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path

import httpx
import pytest

from torchbridge.route.supervisor import EngineProcess, Supervisor

ROOT = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).resolve().parent / "fake_replica.py"
BUNDLED = ROOT / "src" / "torchbridge" / "assets" / "default-model"


def _bench():  # noqa: ANN202 - the benchmark module, whose run_failover the test shares
    spec = importlib.util.spec_from_file_location("bench_serve_failover", ROOT / "bench" / "bench_serve_failover.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _check(r: dict) -> None:
    out = r["up_output"]
    assert r["requests"] > 200, out
    assert r["failure_rate"] < 0.02, (r["failed"], r["requests"], out)
    assert r["failed"] == r["failed_streams"], "a non-streamed request failed: the router should have retried it"
    assert r["restore_s"] is not None, out
    assert r["served_by_r0_after_restore"] > 0, out
    assert "restarting replica r0" in out and r["up_rc"] == 0 and "shutting down" in out


def test_killed_replica_is_restarted_and_serves_again(tmp_path: Path) -> None:
    cmd = f"{sys.executable} {FAKE} --port {{port}} --delay-token-s 0.01"
    # 20 s: enough requests (> 200) for the 2% bound to mean something when the test shares the cores with
    # another test process (make test's second pytest worker: 155 requests in 12 s there)
    r = _bench().run_failover(["--replicas", "2", "--engine-cmd", cmd], duration_s=20.0, concurrency=40,
                              kill_at_s=3.0, max_tokens=8, start_timeout_s=60, log_dir=str(tmp_path))
    _check(r)


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("TB_SLOW") != "1", reason="starts two real engines for 60 s; TB_SLOW=1")
def test_killed_engine_is_restarted_under_30s_of_load(tmp_path: Path) -> None:
    r = _bench().run_failover(["--replicas", "2", "--model", str(BUNDLED)], duration_s=60.0, concurrency=40,
                              kill_at_s=10.0, max_tokens=16, log_dir=str(tmp_path))
    _check(r)


class _Proc:
    def __init__(self) -> None:
        self.pid, self.returncode = 1, None

    def poll(self) -> int | None:
        return self.returncode


def test_backoff_doubles_and_membership_follows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The supervisor's bookkeeping with the processes and the router stubbed: removal on exit, restart
    after the backoff, re-add once healthy, doubling backoff on repeated failures."""
    calls: list[tuple[str, str]] = []
    monkeypatch.setattr(httpx, "request", lambda m, url, **k: calls.append((m, url)) or httpx.Response(200))
    healthy = {"ok": False}
    monkeypatch.setattr("torchbridge.route.supervisor.is_healthy", lambda url, timeout_s=2.0: healthy["ok"])
    e = EngineProcess("r0", "127.0.0.1", 1, lambda p: ["x"], tmp_path / "log")
    starts = []
    monkeypatch.setattr(e, "start", lambda: starts.append(1) or setattr(e, "state", "starting") or
                        setattr(e, "started_at", 0.0) or setattr(e, "proc", _Proc()))
    e.proc, e.state = _Proc(), "healthy"
    sup = Supervisor([e], "http://router", "tok", start_timeout_s=100, log=lambda m: None)
    e.proc.returncode = -9
    sup.tick(now=10.0)
    assert e.state == "down" and calls == [("DELETE", "http://router/admin/replicas/r0")] and not e.in_router
    sup.tick(now=10.5)
    assert not starts  # backoff of 1 s not yet over
    sup.tick(now=11.1)
    assert starts == [1] and e.state == "starting"
    healthy["ok"] = True
    sup.tick(now=12.0)
    assert e.state == "healthy" and calls[-1] == ("POST", "http://router/admin/replicas") and e.in_router
    e.proc.returncode = 1  # dies again at once: the next wait is 2 s
    sup.tick(now=12.5)
    assert e.next_start == pytest.approx(14.5)
    time.sleep(0)
