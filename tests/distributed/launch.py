"""Start a torchrun job for a test: bounded in time, every process stopped by its group at the end.

Each test uses its own fixed port range (see PORTS), so tests never collide with each other or with a
job left over from an earlier run on the same machine. Workers write their results as JSON to `out`
(one file per rank); the test reads them and compares against its reference.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).resolve().parent / "workers"
# Port bases per test module: torchrun's store takes the base; JAX's coordinator finds a free port itself.
PORTS = {"collectives": 29810, "training": 29830, "faults": 29850, "checkpoint": 29870, "compiled": 29890,
         "two_hosts": 29910, "tp_serve": 29930, "bench": 29950, "train": 29970,
         "torchtitan": 29990}


class JobFailed(AssertionError):
    pass


def torchrun(worker: str, nproc: int, port: int, out: Path, args: list[str] | None = None, timeout: float = 300,
             env: dict[str, str] | None = None, expect_ok: bool = True, nnodes: int = 1, node_rank: int = 0,
             master_addr: str = "127.0.0.1", prefix: list[str] | None = None) -> subprocess.CompletedProcess:
    """Run tests/distributed/workers/<worker> on `nproc` ranks; kill the whole job after `timeout` s."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [*(prefix or []), sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           f"--nnodes={nnodes}", f"--node-rank={node_rank}", f"--master-addr={master_addr}",
           f"--master-port={port}", "--max-restarts=0", str(WORKERS / worker), str(out), *(args or [])]
    full_env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={nproc}",
                "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
                # every program goes to the persistent XLA cache: ranks and later jobs reuse what one compiled
                "TORCHBRIDGE_COMPILE_CACHE_MIN_SECS": "0", **(env or {})}
    return run_bounded(cmd, full_env, timeout, f"{worker} on {nproc} ranks", expect_ok)


def run_bounded(cmd: list[str], env: dict[str, str], timeout: float, what: str,
                expect_ok: bool = True) -> subprocess.CompletedProcess:
    """Run `cmd` in its own process group; kill the group after `timeout` s and whatever it left at the end."""
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, _ = proc.communicate()
        raise JobFailed(f"{what} did not finish in {timeout} s; output:\n{stdout[-6000:]}") from None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything the job left behind
        except ProcessLookupError:
            pass
    result = subprocess.CompletedProcess(cmd, proc.returncode, stdout, "")
    if expect_ok and proc.returncode != 0:
        raise JobFailed(f"{what} exited with {proc.returncode}; output:\n{stdout[-6000:]}")
    return result


def results(out: Path, nproc: int) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]
