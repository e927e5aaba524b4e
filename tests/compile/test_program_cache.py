"""Compiled programs kept on disk (compile/program_cache.py): a second process loads the traced program
instead of tracing the graph into JAX again, and gives the same results as CPU eager; a changed graph
or a damaged file is a miss, never a wrong program."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# A compiled function that writes one of its inputs (the engine's KV cache pattern: a donating variant)
# and one that only reads (the plain variant); prints their results and the cache's counters.
JOB = r"""
import json, sys, torch
import torchbridge
from torchbridge.compile import program_cache

scale, device = float(sys.argv[1]), sys.argv[2]
if sys.argv[3] == "traces-only":  # the compiled layer off: XLA's own persistent cache fills, ours keeps traces
    program_cache.load_compiled = lambda name: (False, None)
    program_cache.store_compiled = lambda name, program: None

def write(cache, idx, rows):
    cache.index_copy_(0, idx, rows * scale)
    return cache.sum(dim=1)

def read(x, w):
    return torch.nn.functional.gelu(x @ w) * scale

torch.manual_seed(0)
cache = torch.zeros(4096, 64)
idx, rows = torch.tensor([3, 7, 100]), torch.randn(3, 64)
x, w = torch.randn(8, 32), torch.randn(32, 16)
dev_cache = cache.to(device)
out = {
    "write": torch.compile(write, backend="tpu")(dev_cache, idx.to(device), rows.to(device)).cpu().tolist(),
    "written": dev_cache.cpu()[[3, 7, 100]].tolist(),
    "read": torch.compile(read, backend="tpu")(x.to(device), w.to(device)).cpu().tolist(),
}
ref_cache = cache.clone()
out["ref_write"] = write(ref_cache, idx, rows).tolist()
out["ref_written"] = ref_cache[[3, 7, 100]].tolist()
out["ref_read"] = read(x, w).tolist()
out["stats"] = dict(program_cache.stats)
print("RESULT" + json.dumps(out))
"""


def _run(cache_dir: Path, scale: float = 2.0, device: str = "tpu", layers: str = "all", **env_vars: str) -> dict:
    # the host-GEMM choice pinned: unset, each process measures it (host_calls.gemm_probe), and on a busy
    # machine two processes may choose differently, which is a different program (a miss, rightly)
    env = {**os.environ, "TORCHBRIDGE_COMPILE_CACHE_DIR": str(cache_dir), "TORCHBRIDGE_HOST_GEMM": "1", **env_vars}
    env.pop("TORCHBRIDGE_COMPILE_CACHE", None)
    proc = subprocess.run([sys.executable, "-c", JOB, str(scale), device, layers], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def _assert_matches_cpu(out: dict) -> None:
    import torch

    for name in ("write", "written", "read"):
        torch.testing.assert_close(torch.tensor(out[name]), torch.tensor(out[f"ref_{name}"]), rtol=1e-5, atol=1e-5)


def test_a_second_process_loads_the_programs_and_matches_cpu(tmp_path: Path) -> None:
    first = _run(tmp_path)
    _assert_matches_cpu(first)
    # traced: the writing graph's donating variant and the reading graph's plain one; compiled: the donating one
    assert first["stats"].get("stored", 0) >= 2 and first["stats"].get("hits", 0) == 0, first["stats"]
    assert first["stats"].get("executables_stored", 0) == 1, first["stats"]
    stored = sorted(p.name for p in (tmp_path / "torchbridge-programs").iterdir())
    assert len(stored) == first["stats"]["stored"] + first["stats"]["executables_stored"]
    second = _run(tmp_path)
    _assert_matches_cpu(second)
    # the donating program comes compiled (its trace is not read); the plain one from its trace
    assert second["stats"].get("executable_hits", 0) == 1, second["stats"]
    assert second["stats"].get("hits", 0) == first["stats"]["stored"] - 1, second["stats"]
    assert second["stats"].get("stored", 0) == 0 and second["stats"].get("executables_stored", 0) == 0
    assert second["write"] == first["write"] and second["read"] == first["read"]
    assert second["written"] == first["written"]


def test_only_executables_xla_compiled_in_the_process_are_kept(tmp_path: Path) -> None:
    """An XLA:CPU executable loaded from XLA's persistent cache re-serializes without some of its functions
    (the next process failed running it); such a program is not kept, and the next process still runs
    right, recompiling nothing XLA's cache has."""
    every = {"TORCHBRIDGE_COMPILE_CACHE_MIN_SECS": "0"}  # XLA's cache keeps even these small programs
    _run(tmp_path, layers="traces-only", **every)  # XLA's cache has the programs, ours none compiled
    second = _run(tmp_path, **every)
    _assert_matches_cpu(second)
    assert second["stats"].get("executables_stored", 0) == 0, second["stats"]
    third = _run(tmp_path, **every)
    _assert_matches_cpu(third)
    assert third["stats"].get("executable_hits", 0) == 0, third["stats"]


def test_a_program_compiled_for_one_chip_is_not_loaded_for_another(tmp_path: Path) -> None:
    first = _run(tmp_path)
    # the same graphs on chip 3: their traces load, the executable built for chip 0 does not
    other = _run(tmp_path, device="tpu:3")
    _assert_matches_cpu(other)
    assert other["stats"].get("hits", 0) == first["stats"]["stored"], other["stats"]
    assert other["stats"].get("executable_hits", 0) == 0 and other["stats"].get("executables_stored", 0) == 1
    again = _run(tmp_path, device="tpu:3")
    _assert_matches_cpu(again)
    assert again["stats"].get("executable_hits", 0) == 1, again["stats"]


def test_another_graph_misses_and_a_damaged_file_is_ignored(tmp_path: Path) -> None:
    first = _run(tmp_path, scale=2.0)
    # the constant 3.0 is in the graph's code: other programs, none loaded from the first run's
    other = _run(tmp_path, scale=3.0)
    _assert_matches_cpu(other)
    assert other["stats"].get("hits", 0) == 0 and other["stats"].get("stored", 0) == first["stats"]["stored"]
    for p in (tmp_path / "torchbridge-programs").iterdir():
        p.write_bytes(b"not a program")
    damaged = _run(tmp_path, scale=2.0)
    _assert_matches_cpu(damaged)
    assert damaged["stats"].get("hits", 0) == 0 and damaged["stats"].get("misses", 0) >= 2
    assert damaged["stats"].get("executable_hits", 0) == 0 and damaged["stats"].get("executable_misses", 0) == 1


def test_the_key_covers_the_environment_and_the_matmul_precision(monkeypatch: pytest.MonkeyPatch) -> None:
    from torchbridge.compile import program_cache

    monkeypatch.setenv("TORCHBRIDGE_HOST_GEMM", "1")
    program_cache.environment.cache_clear()  # (hashed once per process: the sources as they are now)
    base = program_cache.key("graph", ("call",), "plain")
    assert program_cache.key("graph", ("call",), ("donating", (0,))) != base
    assert program_cache.key("other graph", ("call",), "plain") != base
    program_cache.environment.cache_clear()
    monkeypatch.setenv("TORCHBRIDGE_HOST_GEMM", "0")
    try:
        assert program_cache.key("graph", ("call",), "plain") != base
    finally:
        monkeypatch.setenv("TORCHBRIDGE_HOST_GEMM", "1")
        program_cache.environment.cache_clear()
    assert program_cache.key("graph", ("call",), "plain") == base
    import torchbridge

    torchbridge.set_matmul_precision("highest")
    try:
        assert program_cache.key("graph", ("call",), "plain") != base
    finally:
        torchbridge.set_matmul_precision("default")
    assert program_cache.key("graph", ("call",), "plain") == base
    monkeypatch.undo()
    program_cache.environment.cache_clear()


MODES = r"""
import torch, torchbridge
from torchbridge.compile import program_cache

def f(x):
    return (x * 2 + 1).sum()

outs = []
for opts in ({}, {"symbolic_sizes": "exact"}):  # one graph code, bounded then exact programs
    g = torch.compile(f, backend="tpu", dynamic=True, options=opts)
    for n in (8, 16):  # powers of two: the bounded program's padded sizes equal the true ones
        x = torch.arange(n, dtype=torch.float32)
        outs.append((float(g(x.to("tpu")).cpu()), float(f(x))))
    torch._dynamo.reset()
print("RESULT", outs, dict(program_cache.stats))
"""


def test_bounded_and_exact_programs_of_one_graph_are_not_confused(tmp_path: Path) -> None:
    env = {**os.environ, "TORCHBRIDGE_COMPILE_CACHE_DIR": str(tmp_path), "TORCHBRIDGE_HOST_GEMM": "1"}
    env.pop("TORCHBRIDGE_COMPILE_CACHE", None)
    for _ in range(2):  # the second process loads what the first stored
        proc = subprocess.run([sys.executable, "-c", MODES], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT"))
        outs = eval(line[len("RESULT"):].split("{")[0].strip().rstrip(","))  # noqa: S307 - our own list of floats
        assert outs and all(ours == ref for ours, ref in outs), outs
