"""Shared fixtures for the engine tests (helpers live in serve_support.py)."""

from __future__ import annotations

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




@pytest.fixture(scope="module")
def server(llama_dir: Path):  # noqa: ANN201 - yields (base_url, async engine)
    """A real uvicorn server on a free loopback port, in a thread; shut down after the module."""
    from torchbridge.serve.async_engine import AsyncEngine
    from torchbridge.serve.config import EngineConfig
    from torchbridge.serve.engine import LLMEngine
    from torchbridge.serve.server import create_app

    cfg = EngineConfig(model=str(llama_dir), block_size=4, num_blocks=256, max_model_len=512,
                       served_model_name="tiny-llama", speculative_ngram=2)
    engine = AsyncEngine(LLMEngine(cfg))
    engine.start()
    try:
        with running_server(create_app(engine, api_key=API_KEY, max_request_bytes=2**20)) as url:
            yield url, engine
    finally:
        engine.shutdown()
