"""The engine in its own process (what `serve` runs) and on a thread of the server's (`--no-engine-process`):
the same answers as Hugging Face through the OpenAI client in both; the engine process's death seen by
the server (streams end with an error, /health 503, new requests refused at once), a model that cannot
load refused at start-up, and no engine process outliving its server, even a killed one."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from serve_support import API_KEY, alive, children, cmdline, hf_greedy, running_server, wait_gone


def _hf_text(llama_dir: Path, ids: list[int], n: int) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_dir)).decode(hf_greedy(llama_dir, ids, n), skip_special_tokens=True)


def test_the_engine_runs_in_another_process(server: tuple, llama_dir: Path) -> None:
    url, engine = server
    state = asyncio.run(engine.engine_state())
    assert state["pid"] == engine.pid != os.getpid() and alive(engine.pid)
    # the HTTP side keeps a core: one torch thread fewer than the cores, unless the user chose
    expected = int(os.environ.get("OMP_NUM_THREADS", max(1, len(os.sched_getaffinity(0)) - 1)))
    assert state["torch_threads"] == expected
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
    r = client.completions.create(model="tiny-llama", prompt=[11, 12, 13], max_tokens=7, temperature=0)
    assert r.choices[0].text == _hf_text(llama_dir, [11, 12, 13], 7)


def test_the_engine_env_leaves_the_server_a_core_and_keeps_the_users_choice() -> None:
    from torchbridge.serve.engine_core import engine_env

    cores = len(os.sched_getaffinity(0))
    env = engine_env("cpu", {"PATH": "/bin"})
    assert env["OMP_NUM_THREADS"] == str(max(1, cores - 1)) and env["TORCHBRIDGE_NO_DEVICE"] == "1"
    assert engine_env("cpu", {"OMP_NUM_THREADS": "7"})["OMP_NUM_THREADS"] == "7"
    assert "TORCHBRIDGE_NO_DEVICE" not in engine_env("tpu:0", {})  # the engine needs the bridge there


def test_the_thread_mode_gives_the_same_answers(llama_dir: Path) -> None:
    from torchbridge.serve.async_engine import AsyncEngine
    from torchbridge.serve.config import EngineConfig
    from torchbridge.serve.engine import LLMEngine
    from torchbridge.serve.server import create_app

    engine = AsyncEngine(LLMEngine(EngineConfig(model=str(llama_dir), block_size=4, num_blocks=64,
                                                max_model_len=256, served_model_name="m")))
    engine.start()
    try:
        with running_server(create_app(engine)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            prompts = [[5, 6, 7, 8], [30, 31]]
            r = client.completions.create(model="m", prompt=prompts, max_tokens=6, temperature=0)
            assert [c.text for c in r.choices] == [_hf_text(llama_dir, p, 6) for p in prompts]
            chunks = client.completions.create(model="m", prompt=prompts[0], max_tokens=6, temperature=0, stream=True)
            assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
            assert httpx.get(url + "/health").status_code == 200
            assert "vllm:generation_tokens_total" in httpx.get(url + "/metrics").text
    finally:
        engine.shutdown()


@pytest.mark.parametrize("process", [True, False], ids=["engine-process", "thread"])
def test_buckets_left_for_idle_time_are_warmed_while_serving(llama_dir: Path, process: bool) -> None:
    """`--warmup idle` (serve's default with shape buckets): healthy after the first bucket of each kind, the
    rest warmed by the engine loop when idle (the /metrics gauge counts them down to 0); answers as HF's."""
    from torchbridge.serve.async_engine import AsyncEngine
    from torchbridge.serve.config import EngineConfig
    from torchbridge.serve.engine import LLMEngine
    from torchbridge.serve.engine_process import EngineProcess
    from torchbridge.serve.server import create_app

    config = EngineConfig(model=str(llama_dir), block_size=4, num_blocks=64, max_model_len=64, max_num_seqs=4,
                          max_num_batched_tokens=32, shape_buckets=True, served_model_name="m")
    if process:
        engine = EngineProcess(config, "idle")
    else:
        eng = LLMEngine(config)
        eng.warmup(everything=False)
        engine = AsyncEngine(eng)
    engine.start()
    try:
        with running_server(create_app(engine)) as url:
            assert httpx.get(url + "/health").status_code == 200
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            r = client.completions.create(model="m", prompt=[5, 6, 7, 8], max_tokens=6, temperature=0)
            assert r.choices[0].text == _hf_text(llama_dir, [5, 6, 7, 8], 6)
            deadline, pending = time.monotonic() + 120, None
            while time.monotonic() < deadline:
                line = next(x for x in httpx.get(url + "/metrics").text.splitlines()
                            if x.startswith("torchbridge:warmup_pending_buckets{"))
                pending = float(line.rsplit(" ", 1)[1])
                if pending == 0:
                    break
                time.sleep(0.2)
            assert pending == 0
    finally:
        engine.shutdown()


def test_a_dead_engine_process_fails_streams_and_refuses_new_requests(llama_dir: Path) -> None:
    from torchbridge.serve.config import EngineConfig
    from torchbridge.serve.engine_process import EngineProcess
    from torchbridge.serve.server import create_app

    engine = EngineProcess(EngineConfig(model=str(llama_dir), block_size=4, num_blocks=64, max_model_len=512,
                                        served_model_name="m"))
    engine.start()
    try:
        with running_server(create_app(engine)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
            stream = client.completions.create(model="m", prompt=[5, 6, 7], max_tokens=480, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})
            started = time.monotonic()
            with pytest.raises(openai.APIError, match="engine process exited"):
                for chunk in stream:
                    if chunk.choices and chunk.choices[0].text and alive(engine.pid):
                        os.kill(engine.pid, signal.SIGKILL)
            assert time.monotonic() - started < 30
            health = httpx.get(url + "/health", timeout=10)
            assert health.status_code == 503 and "engine process" in health.json()["error"]["message"]
            t = time.monotonic()
            with pytest.raises(openai.InternalServerError):
                client.completions.create(model="m", prompt=[5, 6], max_tokens=2)
            assert time.monotonic() - t < 10  # refused, not waited on
    finally:
        engine.shutdown()


def test_a_model_that_cannot_load_is_refused_at_start(tmp_path: Path, llama_dir: Path) -> None:
    from torchbridge.serve.config import EngineConfig
    from torchbridge.serve.engine_process import EngineProcess

    broken = tmp_path / "no-weights"
    broken.mkdir()
    (broken / "config.json").write_bytes((llama_dir / "config.json").read_bytes())  # the config, no weights
    engine = EngineProcess(EngineConfig(model=str(broken), block_size=4, num_blocks=16))
    with pytest.raises(RuntimeError, match="the engine failed to start: .*safetensors|the engine failed to start"):
        engine.start()
    assert engine.pid is not None and wait_gone([engine.pid], 30) == []


def test_no_engine_process_outlives_its_killed_server(llama_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torchbridge", "serve", "--model", str(llama_dir), "--port", str(port),
           "--max-model-len", "64", "--block-size", "4", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stderr.read().decode()[-3000:] if proc.stderr else "server exited"
            assert time.monotonic() < deadline, "server did not come up in 120 s"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        engines = [p for p in children(proc.pid) if b"torchbridge.serve.engine_core" in cmdline(p)]
        assert len(engines) == 1, [cmdline(p) for p in children(proc.pid)]
        body = {"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        out = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        assert out["choices"][0]["text"] == _hf_text(llama_dir, [5, 6, 7], 4), json.dumps(out)
        os.kill(proc.pid, signal.SIGKILL)  # no shutdown code runs in the server
        proc.wait(timeout=30)
        assert wait_gone(engines, 30) == [], "the engine process outlived its killed server"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)

