"""Tensor-parallel serving (`tensor_parallel_size` / `--tensor-parallel-size`, vLLM's names).

Greedy tokens of a mixed batch (prompts of different lengths, chunked prefill mixing with decodes,
requests that stop after 1 or 2 tokens next to longer ones, prefix-cache hits) at 2 ranks equal the
single-rank engine's and Hugging Face generate()'s on the same tiny random-init model (the independent
reference), with the model really sharded; the same through the OpenAI server with the official
`openai` client; a worker that dies fails the requests with an OpenAI-style 500 error, never a hang;
no worker outlives its server (checked by PID); bad sizes are refused before any worker starts.

Every tensor-parallel engine runs in a process of its own (tp_job.py, or the server): it makes a
process group, and its workers are that process's children. Each such process is started in a new
session and killed by its group at the end; every wait is bounded. The group's store takes a fixed
port from tests/distributed/launch.py's "tp_serve" range (offsets 0-9). Default run: cpu (gloo) and
the bridge's device (each step's graph compiled, the default there), 2 ranks. TB_SLOW=1 adds 4 ranks,
the other architectures, the bridge's device op by op, and a worker's death on the bridge's device.
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
from serve_support import alive, children, cmdline, hf_greedy, save_model, wait_gone

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from launch import PORTS  # noqa: E402 - the port ranges shared by every multi-process test

SLOW = os.environ.get("TB_SLOW") == "1"
JOB = Path(__file__).resolve().parent / "tp_job.py"
slow = pytest.mark.skipif(not SLOW, reason="slow variant (a minute or more on 2 cores): TB_SLOW=1")


def _env(port_offset: int, nproc: int = 8, **extra: str) -> dict[str, str]:
    return {**os.environ, "TORCHBRIDGE_TP_PORT": str(PORTS["tp_serve"] + port_offset),
            "XLA_FLAGS": f"--xla_force_host_platform_device_count={nproc}", "TORCH_CPP_LOG_LEVEL": "ERROR",
            "TORCHBRIDGE_HEARTBEAT_TIMEOUT": "20", "TORCHBRIDGE_TP_TIMEOUT": "120",
            "TORCHBRIDGE_COMPILE_CACHE_MIN_SECS": "0", **extra}


def _stop(proc: subprocess.Popen) -> None:
    """Kill the job's whole process group (its session: the job and the workers it started)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def tp_run(tmp_path: Path, model_dir: Path, tp: int, device: str, port_offset: int, timeout: float = 300,
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


def _workers(pid: int) -> list[int]:
    """The tensor-parallel worker processes under `pid` (the server's engine process starts them)."""
    found, todo = [], [pid]
    while todo:
        for kid in children(todo.pop()):
            todo.append(kid)
            if b"torchbridge.serve.workers" in cmdline(kid):
                found.append(kid)
    return found


# ---- offline API: tokens against N=1 and Hugging Face --------------------------------------------
@pytest.fixture(scope="module")
def odd_vocab_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tied embeddings and a vocabulary (323) that 2 and 4 ranks do not divide: the shards are padded.
    No tokenizer: ids past the tokenizer's 320 would not decode; the engine then works in ids."""
    return save_model(tmp_path_factory.mktemp("odd-vocab"), "llama", None, vocab_size=323, tie_word_embeddings=True)


def _hf_rounds(model_dir: Path) -> list[list[list[int]]]:
    """Hugging Face generate(), greedy, each prompt alone with its own token limit (stops at EOS too)."""
    return [[hf_greedy(model_dir, p, tp_job.max_new(i)) for i, p in enumerate(batch)]
            for batch in tp_job.prompts(323)]


@pytest.fixture(scope="module")
def references(odd_vocab_dir: Path) -> tuple[list, dict]:
    """(HF generate's tokens, the single-rank engine's run) for the odd-vocabulary model."""
    return _hf_rounds(odd_vocab_dir), tp_job.run(str(odd_vocab_dir), 1, "cpu")


def _check(got: dict, hf: list, single: dict, tp: int, kv_heads: int = 2) -> None:
    assert single["rounds"] == hf  # the reference engine itself is right
    assert got["rounds"] == hf
    assert got["finish_reasons"] == single["finish_reasons"]
    lengths = [len(t) for r in hf for t in r]
    assert min(lengths) == 1 and max(lengths) >= 10  # some stopped after one token while others went on
    assert got["prefix_hits"] > 0 and got["prefix_hits"] == single["prefix_hits"]
    assert got["mixed_steps"] > 0  # some step ran prefill chunks next to decodes
    # really sharded: this rank caches and projects only its share of the heads, next to tp - 1 workers
    assert got["local_kv_heads"] == kv_heads // tp and got["local_qkv_rows"] * tp == single["local_qkv_rows"]
    assert len(got["worker_pids"]) == tp - 1 and not any(alive(p) for p in got["worker_pids"])


def test_two_ranks_on_cpu_give_hf_and_single_rank_tokens(tmp_path: Path, odd_vocab_dir: Path,
                                                         references: tuple) -> None:
    hf, single = references
    _check(tp_run(tmp_path, odd_vocab_dir, 2, "cpu", port_offset=0), hf, single, 2)


def test_two_ranks_on_the_bridge_device_compiled(tmp_path: Path, odd_vocab_dir: Path, references: tuple) -> None:
    hf, single = references
    got = tp_run(tmp_path, odd_vocab_dir, 2, "tpu", port_offset=2, timeout=480)  # 169 s seen, cold cache, 2 workers
    _check(got, hf, single, 2)
    c = got["compile"]
    # each step one graph with its collectives inside (all-reduces and the LM head's all-gather), no breaks
    assert c["collective_graphs"] > 0 and c["graph_breaks"] == 0, c


@slow
def test_two_ranks_on_the_bridge_device_op_by_op(tmp_path: Path, odd_vocab_dir: Path, references: tuple) -> None:
    hf, single = references
    _check(tp_run(tmp_path, odd_vocab_dir, 2, "tpu", port_offset=3, compile_model=False), hf, single, 2)


@slow
def test_four_ranks_on_cpu(tmp_path: Path) -> None:
    # 4 key/value heads, so that 4 ranks hold one each
    model = save_model(tmp_path / "kv4", "llama", None, vocab_size=323, num_key_value_heads=4)
    got = tp_run(tmp_path, model, 4, "cpu", port_offset=4)
    _check(got, _hf_rounds(model), tp_job.run(str(model), 1, "cpu"), 4, kv_heads=4)


@slow
@pytest.mark.parametrize("arch", ["qwen2", "qwen3_moe", "mistral"])
def test_other_architectures_on_cpu(tmp_path: Path, arch: str) -> None:
    # qwen2: q/k/v biases split with their rows; qwen3_moe: every expert split, one reduce per layer;
    # mistral: a sliding window over a rank's heads
    model = save_model(tmp_path / arch, arch, None, vocab_size=323)
    _check(tp_run(tmp_path, model, 2, "cpu", port_offset=5), _hf_rounds(model), tp_job.run(str(model), 1, "cpu"), 2)


# ---- refused before any worker starts --------------------------------------------------------------
def test_sizes_the_model_cannot_be_split_by_are_refused(llama_dir: Path, capsys: pytest.CaptureFixture) -> None:
    from torchbridge.serve.cli import main
    from torchbridge.serve.config import EngineConfig

    # the test model has 4 attention heads and 2 key/value heads
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4 must divide the model's 2 key/value heads.*1, 2"):
        EngineConfig(model=str(llama_dir), tensor_parallel_size=4)
    with pytest.raises(ValueError, match="--tensor-parallel-size 3 must divide the model's 4 attention heads"):
        EngineConfig(model=str(llama_dir), tensor_parallel_size=3)
    with pytest.raises(ValueError, match="--tensor-parallel-size must be at least 1"):
        EngineConfig(model=str(llama_dir), tensor_parallel_size=0)
    before = set(children(os.getpid()))
    assert main(["--model", str(llama_dir), "--tensor-parallel-size", "4"]) == 2
    assert "torchbridge serve: --tensor-parallel-size 4 must divide" in capsys.readouterr().err
    assert set(children(os.getpid())) <= before  # no worker was started


def test_more_ranks_than_chips_are_refused(llama_dir: Path) -> None:
    # 1 emulated chip for 2 ranks; in a fresh process (the flag is read when JAX starts)
    cmd = [sys.executable, "-m", "torchbridge", "serve", "--model", str(llama_dir), "--device", "tpu",
           "--tensor-parallel-size", "2"]
    out = subprocess.run(cmd, env=_env(9, nproc=1), capture_output=True, text=True, timeout=180)
    assert out.returncode == 2, out.stderr[-3000:]
    assert "--tensor-parallel-size 2 needs chips tpu:0..1, one per rank, but this host has 1" in out.stderr


def test_a_process_that_used_the_device_already_is_refused(llama_dir: Path) -> None:
    import torch

    from torchbridge.serve.config import EngineConfig

    torch.zeros(1, device="tpu")  # JAX's backend starts here, without its distributed runtime
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 on tpu: the device was already used"):
        EngineConfig(model=str(llama_dir), device="tpu", tensor_parallel_size=2)


# ---- through the OpenAI server -------------------------------------------------------------------
def _start_server(llama_dir: Path, port_offset: int, max_model_len: int = 64) -> tuple[subprocess.Popen, str]:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        http_port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torchbridge", "serve", "--model", str(llama_dir), "--port", str(http_port),
           "--tensor-parallel-size", "2", "--max-model-len", str(max_model_len), "--block-size", "4",
           "--log-level", "warning", "--served-model-name", "tp"]
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


def _client(url: str):  # noqa: ANN202 - openai.OpenAI
    import openai

    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)


PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [9]]


def test_openai_server_gives_hf_tokens_and_its_killing_stops_the_workers(llama_dir: Path) -> None:
    proc, url = _start_server(llama_dir, port_offset=6)
    try:
        workers = _workers(proc.pid)
        assert len(workers) == 1, workers  # rank 1
        out = _client(url).completions.create(model="tp", prompt=PROMPTS, max_tokens=6, temperature=0,
                                              logprobs=0, extra_body={"ignore_eos": True})
        choices = sorted(out.choices, key=lambda c: c.index)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(llama_dir))
        hf = [tok.decode(hf_greedy(llama_dir, p, 6)) for p in PROMPTS]
        assert [c.text for c in choices] == hf
        os.kill(proc.pid, signal.SIGKILL)  # no shutdown code runs in the server
        proc.wait(timeout=30)
        assert wait_gone(workers, 15) == [], "a tensor-parallel worker outlived its killed server"
    finally:
        _stop(proc)


def test_a_dead_worker_fails_requests_with_an_error_and_the_server_stops_cleanly(llama_dir: Path) -> None:
    import openai

    proc, url = _start_server(llama_dir, port_offset=7, max_model_len=1024)
    try:
        (worker,) = _workers(proc.pid)
        client = _client(url)
        # a long generation; the worker is killed once its first tokens came back
        stream = client.completions.create(model="tp", prompt=[5, 6, 7], max_tokens=1000, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        started = time.monotonic()
        got = 0
        with pytest.raises(openai.APIError, match=r"tensor-parallel worker rank 1 \(pid \d+\) exited"):
            for chunk in stream:
                got += len(chunk.choices[0].text) if chunk.choices else 0
                if got and alive(worker):
                    os.kill(worker, signal.SIGKILL)
        assert time.monotonic() - started < 60
        # later requests: an OpenAI-style 500 at once, and /health says why
        with pytest.raises(openai.InternalServerError) as e:
            client.completions.create(model="tp", prompt=[5, 6], max_tokens=3)
        assert "tensor-parallel worker rank 1" in e.value.body["message"], e.value.body
        health = httpx.get(f"{url}/health", timeout=10)
        assert health.status_code == 503 and "tensor-parallel worker rank 1" in health.text
        proc.send_signal(signal.SIGTERM)  # uvicorn's orderly exit: the engine shuts down
        assert proc.wait(timeout=60) == 0
        assert wait_gone([worker], 5) == []
    finally:
        _stop(proc)


# ---- a worker's death on the bridge's device -----------------------------------------------------
@slow
def test_a_dead_worker_on_the_bridge_device_fails_the_engine_in_bounded_time(tmp_path: Path, llama_dir: Path) -> None:
    # JAX's runtime would end the engine's process once the dead worker's heartbeats stop: it must not
    out = tmp_path / "dead.json"
    code = f"""
import json, os, signal, sys, time
sys.path.insert(0, {str(Path(__file__).parent)!r})
from torchbridge.serve import LLM, SamplingParams
llm = LLM({str(llama_dir)!r}, device="tpu", tensor_parallel_size=2, block_size=4, max_model_len=64)
p = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
llm.generate([[5, 6, 7]], p)
(pid,) = llm.engine.runner.workers.pids
os.kill(pid, signal.SIGKILL)
t = time.monotonic()
try:
    o = llm.generate([[5, 6, 7, 8]], p)
    err = o[0].outputs[0].finish_reason
except Exception as e:
    err = repr(e)
res = {{"error": str(err), "seconds": time.monotonic() - t, "pid": pid}}
time.sleep(30)  # past JAX's heartbeat timeout (20 s here): the engine's process must survive it
json.dump(res, open({str(out)!r}, "w"))
"""
    proc = subprocess.Popen([sys.executable, "-c", code], env=_env(8), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=240)
    finally:
        _stop(proc)
    assert out.exists(), log[-4000:]
    assert proc.returncode == 0, log[-4000:]  # and then it exited by itself (JAX's exit hook did not wait)
    res = json.loads(out.read_text())
    assert res["seconds"] < 60 and not alive(res["pid"]), res
    assert res["error"] == "error", (res, log[-3000:])  # the request failed (finish_reason "error")
