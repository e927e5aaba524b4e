"""Tensor-parallel serving (`tensor_parallel_size` / `--tensor-parallel-size`): greedy tokens of a mixed
batch (different prompt lengths, chunked prefill mixing with decodes, prefix-cache hits) equal to the
single-rank engine's, with the model really sharded; workers gone when the server is killed; a size
the model cannot be split by refused at start-up.

Every tensor-parallel engine runs in a process of its own (tp_job.py, or the server): it makes a
process group, and its workers are that process's children. Each such process is started in a new
session and killed by its group at the end; every wait is bounded. The group's store takes a fixed
port from tests/distributed/launch.py's "tp_serve" range. Default run: cpu (gloo) with 2 ranks; with
TB_SLOW=1 also 4 ranks, the other architectures, a worker's death, and the bridge's device (each
step's graph compiled, and op by op).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import tp_job
from serve_support import save_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from launch import PORTS  # noqa: E402 - the port ranges shared by every multi-process test

SLOW = os.environ.get("TB_SLOW") == "1"
JOB = Path(__file__).resolve().parent / "tp_job.py"


def _env(port_offset: int, nproc: int = 8) -> dict[str, str]:
    return {**os.environ, "TORCHBRIDGE_TP_PORT": str(PORTS["tp_serve"] + port_offset),
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={nproc}", "TORCH_CPP_LOG_LEVEL": "ERROR",
            "TORCHBRIDGE_HEARTBEAT_TIMEOUT": "20"}


def _stop(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def tp_run(tmp_path: Path, model_dir: Path, tp: int, device: str, port_offset: int, timeout: float = 240,
           **engine_args: object) -> dict:
    """tp_job.run in its own process (and session); killed by its group when it is over or too slow."""
    out = tmp_path / f"tp{tp}-{device}-{port_offset}.json"
    cmd = [sys.executable, str(JOB), str(out), str(model_dir), str(tp), device, json.dumps(engine_args)]
    proc = subprocess.Popen(cmd, env=_env(port_offset), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _stop(proc)
        pytest.fail(f"the tensor-parallel job did not finish in {timeout} s: {proc.stdout.read()[-4000:]}")
    finally:
        _stop(proc)
    assert proc.returncode == 0, log[-6000:]
    return json.loads(out.read_text())


def _alive(pid: int) -> bool:
    """Whether process `pid` still runs (a zombie waiting for its reaper does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state not in ("Z", "X")


def _children(pid: int) -> list[int]:
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (FileNotFoundError, IndexError, ProcessLookupError):
            continue
        if int(fields[1]) == pid:
            kids.append(int(stat.parent.name))
    return kids


@pytest.fixture(scope="module")
def odd_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings and a vocabulary (323) that 2 and 4 ranks do not divide: the shards are padded.
    No tokenizer: ids past the tokenizer's 320 would not decode; the engine then works in ids."""
    return save_model(tmp_path_factory.mktemp("odd-vocab"), "llama", None, vocab_size=323, tie_word_embeddings=True)


def _check_against_single_rank(got: dict, ref: dict, tp: int, kv_heads: int) -> None:
    assert got["rounds"] == ref["rounds"]
    assert got["prefix_hits"] > 0 and got["prefix_hits"] == ref["prefix_hits"]
    assert got["mixed_steps"] > 0  # some step ran prefill chunks next to decodes
    # really sharded: this rank caches and projects only its share of the heads, next to tp - 1 workers
    assert got["local_kv_heads"] == kv_heads // tp and got["local_qkv_rows"] * tp == ref["local_qkv_rows"]
    assert len(got["worker_pids"]) == tp - 1 and not any(_alive(p) for p in got["worker_pids"])


def test_two_ranks_on_cpu_give_the_single_rank_tokens(tmp_path: Path, odd_vocab_dir: Path) -> None:
    ref = tp_job.run(str(odd_vocab_dir), 1, "cpu")
    got = tp_run(tmp_path, odd_vocab_dir, 2, "cpu", port_offset=0)
    _check_against_single_rank(got, ref, 2, kv_heads=2)


def test_a_size_the_model_cannot_be_split_by_is_refused(llama_dir: Path, capsys: pytest.CaptureFixture) -> None:
    from torchbridge.serve.cli import main
    from torchbridge.serve.config import EngineConfig

    # the test model has 4 attention heads and 2 key/value heads
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 must divide the model's 2 key/value heads.*1, 2"):
        EngineConfig(model=str(llama_dir), tensor_parallel_size=4)
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 must divide the model's 4 attention heads"):
        EngineConfig(model=str(llama_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="--tensor-parallel-size must be at least 1"):
        EngineConfig(model=str(llama_dir), tensor_parallel_size=0)
    assert main(["--model", str(llama_dir), "--tensor-parallel-size", "4"]) == 2
    assert "--tensor-parallel-size 4 must divide" in capsys.readouterr().err


def _start_server(llama_dir: Path, port_offset: int) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torchbridge", "serve", "--model", str(llama_dir), "--port", str(http_port),
           "--tensor-parallel-size", "2", "--max-model-len", "64", "--block-size", "4", "--log-level", "warning",
           "--served-model-name", "tp"]
    proc = subprocess.Popen(cmd, env=_env(port_offset), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True)
    url = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 180
    while True:
        if proc.poll() is not None:
            _stop(proc)
            pytest.fail(f"server exited: {proc.stderr.read().decode()[-4000:]}")
        if time.monotonic() > deadline:
            _stop(proc)
            pytest.fail("server did not come up in 180 s")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)


PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [9]]


def _complete(url: str) -> httpx.Response:
    body = {"model": "tp", "prompt": PROMPTS, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def _single_rank_texts(llama_dir: Path) -> list[str]:
    from torchbridge.serve import LLM, SamplingParams

    llm = LLM(str(llama_dir), block_size=4, max_model_len=64)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


def _wait_gone(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def test_killing_the_server_stops_its_workers(llama_dir: Path) -> None:
    proc, url = _start_server(llama_dir, port_offset=1)
    try:
        workers = _children(proc.pid)
        assert len(workers) == 1, workers  # rank 1
        out = _complete(url).json()
        assert [c["text"] for c in sorted(out["choices"], key=lambda c: c["index"])] == _single_rank_texts(llama_dir)
        os.kill(proc.pid, signal.SIGKILL)  # no shutdown code runs in the server
        proc.wait(timeout=30)
        assert _wait_gone(workers, 15) == [], "a tensor-parallel worker outlived its killed server"
    finally:
        _stop(proc)
