"""Shared fixtures for the engine tests (helpers live in serve_support.py)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
from serve_support import API_KEY, build_tokenizer, running_server, save_model


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(d)
    return d


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    return save_model(tmp_path_factory.mktemp("llama"), "llama", tokenizer_dir)


def _config(llama_dir: Path):  # noqa: ANN202 - an EngineConfig
    from torchbridge.serve.config import EngineConfig

    return EngineConfig(model=str(llama_dir), block_size=4, num_blocks=256, max_model_len=512,
                        served_model_name="tiny-llama", speculative_ngram=2)


@contextlib.contextmanager
def _serving(engine):  # noqa: ANN001, ANN202 - an EngineClient; yields (base_url, engine)
    """Start the engine, serve it with uvicorn on a free loopback port, shut both down afterwards."""
    from torchbridge.serve.server import create_app

    engine.start()
    try:
        with running_server(create_app(engine, api_key=API_KEY, max_request_bytes=2**20)) as url:
            yield url, engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def server(llama_dir: Path):  # noqa: ANN201 - yields (base_url, engine client)
    """A real uvicorn server on a free loopback port, in a thread, over an engine in its own process (what
    `serve` runs); shut down after the module."""
    from torchbridge.serve.engine_process import EngineProcess

    with _serving(EngineProcess(_config(llama_dir))) as served:
        yield served


@pytest.fixture(scope="module")
def inproc_server(llama_dir: Path):  # noqa: ANN201 - yields (base_url, AsyncEngine)
    """The same server over the engine stepped by a thread of this process (`serve --no-engine-process`):
    for tests that inject faults by patching the engine, which they can only reach here. Both loops share
    the step's failure handling (async_engine.step_or_fail_all) and the refusal of a request."""
    from torchbridge.serve.async_engine import AsyncEngine
    from torchbridge.serve.engine import LLMEngine

    with _serving(AsyncEngine(LLMEngine(_config(llama_dir)))) as served:
        yield served
