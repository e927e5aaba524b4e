"""A rank that dies makes the others fail with a clear error, never hang: its peers' next collective
raises (gloo's transport sees the closed connection), and under torchrun the job ends with the dead
rank named. Every wait is bounded by the test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from launch import PORTS, WORKERS, torchrun


def test_peer_death_fails_the_next_collective(tmp_path):
    port = PORTS["faults"]
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port), "WORLD_SIZE": "2", "TORCHBRIDGE_HEARTBEAT_TIMEOUT": "10", "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKERS / "faults.py"), str(tmp_path)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    start = time.monotonic()
    try:
        outs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == 3
    result = json.loads((tmp_path / "rank0.json").read_text())
    assert not result["completed"], result
    assert "closed" in result["error"].lower() or "failed" in result["error"].lower(), result["error"]
    assert result["seconds"] < 60, result
    assert procs[0].returncode != 0, outs[0][-2000:]  # and the survivor exits with an error, not 0
    assert time.monotonic() - start < 180


def test_torchrun_job_with_a_dead_rank_ends(tmp_path):
    start = time.monotonic()
    job = torchrun("faults.py", 2, PORTS["faults"] + 1, tmp_path, timeout=180, expect_ok=False,
                   env={"TORCHBRIDGE_HEARTBEAT_TIMEOUT": "10"})
    assert job.returncode != 0
    assert "exitcode  : 3" in job.stdout, job.stdout[-3000:]  # torchrun names the rank that died
    assert time.monotonic() - start < 180
