"""`python -m torchbridge serve`: argument handling, the default-model path, and a real start-up."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from torchbridge.serve import default_model_dir
from torchbridge.serve.cli import build_parser, main


def test_default_model_dir_is_the_bundled_asset() -> None:
    import torchbridge

    assert default_model_dir() == Path(torchbridge.__file__).parent / "assets" / "default-model"


def test_missing_model_fails_with_a_clear_message(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--model", str(tmp_path / "nowhere")]) == 2
    assert "no Hugging Face checkpoint" in capsys.readouterr().err


def test_bad_speculative_config_fails_with_a_clear_message(llama_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["--model", str(llama_dir), "--speculative-config", '{"method": "eagle3", "model": "x"}']) == 2
    assert "not implemented" in capsys.readouterr().err
    assert main(["--model", str(llama_dir), "--speculative-config", "{not json"]) == 2
    assert "torchbridge serve:" in capsys.readouterr().err


def test_flags_parse() -> None:
    ns = build_parser().parse_args(["--no-enable-prefix-caching", "--speculative-ngram", "3", "--shape-buckets",
                                    "--api-key", "k", "--num-blocks", "9", "--device", "cpu", "--tool-call-parser",
                                    "hermes", "--enable-auto-tool-choice", "--max-request-bytes", "1000"])
    assert not ns.enable_prefix_caching and ns.speculative_ngram == 3 and ns.shape_buckets and ns.api_key == "k"
    assert ns.num_blocks == 9 and ns.tool_call_parser == "hermes" and ns.enable_auto_tool_choice
    assert ns.max_request_bytes == 1000


def test_serve_subcommand_starts_a_server(llama_dir: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torchbridge", "serve", "--model", str(llama_dir), "--port", str(port),
           "--served-model-name", "cli-model", "--max-model-len", "64", "--log-level", "warning",
           # the model as its own draft: every greedy draft is accepted
           "--speculative-config", f'{{"model": "{llama_dir}", "num_speculative_tokens": 2}}']
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else "server exited"
            assert time.monotonic() < deadline, "server did not come up"
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except httpx.HTTPError:
                time.sleep(0.25)
        assert r.json()["data"][0]["id"] == "cli-model"
        body = {"model": "cli-model", "prompt": [5, 6, 7], "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        out = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 8
        metrics = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        accepted = [float(x.split()[-1]) for x in metrics.splitlines()
                    if x.startswith("vllm:spec_decode_num_accepted_tokens_total")]
        assert accepted and accepted[0] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=30)
