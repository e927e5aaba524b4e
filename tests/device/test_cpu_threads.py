"""TORCHBRIDGE_XLA_CPU_THREADS (device/cpu_threads.py): XLA's CPU client started with N threads per pool, every
thread keeping all of the process's CPUs, results unchanged; a bad value named. Each case in a fresh
interpreter: the pools are made once, when JAX's backend starts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

_PROBE = r"""
import collections, json, os
import torch
import torchbridge
from torchbridge.device.runtime import STATE

if STATE.platform != "cpu":
    print(json.dumps({"platform": STATE.platform}))
    raise SystemExit(0)
a = torch.randn(64, 48, generator=torch.Generator().manual_seed(0))
b = torch.randn(48, 32, generator=torch.Generator().manual_seed(1))
got = (a.to(torchbridge.device_name()) @ b.to(torchbridge.device_name())).relu().cpu()
names = collections.Counter()
masks = set()
for tid in os.listdir("/proc/self/task"):
    try:
        names[open(f"/proc/self/task/{tid}/comm").read().strip()] += 1
        masks.add(len(os.sched_getaffinity(int(tid))))
    except OSError:  # a thread that ended meanwhile
        pass
print(json.dumps({"platform": "cpu", "eigen": names["tf_XLAEigen"], "masks": sorted(masks),
                  "max_error": float((got - (a @ b).relu()).abs().max())}))
"""


def _probe(threads: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TORCHBRIDGE_XLA_CPU_THREADS"}
    env.pop("XLA_FLAGS", None)  # one CPU device: the pools' sizes are the CPUs', not the emulated chips'
    if threads is not None:
        env["TORCHBRIDGE_XLA_CPU_THREADS"] = threads
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_xla_cpu_pools_take_the_thread_count_and_every_thread_keeps_all_cpus() -> None:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    if cpus < 2:
        pytest.skip(f"this process may run on {cpus} CPU: XLA's pools are one thread each already")
    default = _probe(None)
    if default["platform"] != "cpu":
        pytest.skip(f"the setting sizes XLA's CPU client; this device runs on {default['platform']}")
    one = _probe("1")
    # XLA's intra-op pool: one thread per CPU by default, one thread with the setting
    assert default["eigen"] == cpus, default
    assert one["eigen"] == 1, one
    # narrowing is only for the start: the pools' threads (and all others) run on every CPU afterwards
    assert one["masks"] == [cpus] and default["masks"] == [cpus], (one, default)
    assert one["max_error"] < 1e-4 and default["max_error"] < 1e-4, (one, default)
    # as many threads as CPUs or more: XLA's own sizing
    assert _probe(str(cpus + 3))["eigen"] == cpus


def test_a_bad_thread_count_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.device import cpu_threads

    for bad in ("0", "-2", "two"):
        monkeypatch.setenv(cpu_threads.ENV, bad)
        with pytest.raises(ValueError, match="TORCHBRIDGE_XLA_CPU_THREADS must be a positive number"):
            cpu_threads.requested()
    monkeypatch.setenv(cpu_threads.ENV, " ")
    assert cpu_threads.requested() is None
    monkeypatch.setenv(cpu_threads.ENV, "3")
    assert cpu_threads.requested() == 3
