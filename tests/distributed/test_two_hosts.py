"""Two hosts: DDP and FSDP2 again with `torchrun --nnodes 2`, each node in its own network namespace
(a veth pair, an address per namespace, created and removed by the test), so nothing assumes one host
or loopback: not JAX's coordinator, not the c10d store, not either gloo transport, not the device
mapping. Results equal the same job on one host with CPU tensors and gloo. Needs root for
`ip netns` (skipped, saying so, without it) and runs with TB_SLOW=1 (`make test-all`)."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid

import pytest
import torch
from launch import PORTS, WORKERS, torchrun
from test_parallel_training import _compare

pytestmark = pytest.mark.skipif(os.environ.get("TB_SLOW") != "1", reason="two network namespaces: TB_SLOW=1")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def hosts():
    tag = uuid.uuid4().hex[:6]
    names = [f"tb{tag}a", f"tb{tag}b"]
    addrs = ["10.77.0.1", "10.77.0.2"]
    try:
        for n in names:
            _ip("netns", "add", n)
    except (subprocess.CalledProcessError, FileNotFoundError, PermissionError) as e:
        for n in names:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)
        pytest.skip(f"cannot create network namespaces here ({e}); needs root and iproute2")
    try:
        _ip("link", "add", f"v{tag}a", "type", "veth", "peer", "name", f"v{tag}b")
        for n, dev, addr in zip(names, (f"v{tag}a", f"v{tag}b"), addrs, strict=True):
            _ip("link", "set", dev, "netns", n)
            _ip("-n", n, "addr", "add", f"{addr}/24", "dev", dev)
            _ip("-n", n, "link", "set", dev, "up")
            _ip("-n", n, "link", "set", "lo", "up")
        yield list(zip(names, addrs, strict=True))
    finally:
        for n in names:  # removing a namespace removes its end of the veth pair, and so the pair
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def _two_node_job(tmp_path, hosts, mode: str, port: int) -> list[dict]:
    out = tmp_path / "two_hosts"
    master = hosts[0][1]
    procs = []
    for node, (ns, _) in enumerate(hosts):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1",
               f"--master-addr={master}", f"--master-port={port}", "--max-restarts=0", str(WORKERS / "training.py"),
               str(out), mode, "tpu", "0"]
        env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "OMP_NUM_THREADS": "1"}
        out.mkdir(parents=True, exist_ok=True)
        procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *cmd], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, start_new_session=True))
    try:
        logs = [p.communicate(timeout=400)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-4000:]
    return [torch.load(out / "tpu" / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_two_hosts_train_like_one_host_on_cpu(tmp_path, hosts, mode):
    ref_out = tmp_path / "cpu"
    torchrun("training.py", 2, PORTS["two_hosts"], ref_out, [mode, "cpu", "0"], timeout=400)
    ref = [torch.load(ref_out / "cpu" / f"rank{r}.pt") for r in range(2)]
    got = _two_node_job(tmp_path, hosts, mode, PORTS["two_hosts"] + 1)
    _compare(ref, got, mixed=False)
