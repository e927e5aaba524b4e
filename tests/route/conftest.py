"""Fixtures: fake replicas and routers served by uvicorn on 127.0.0.1 free ports."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fake_replica import Knobs, ServerThread, make_app  # noqa: E402

from torchbridge.route.cli import free_port  # noqa: E402
from torchbridge.route.config import parse_config  # noqa: E402
from torchbridge.route.proxy import create_app  # noqa: E402


class Fake:
    def __init__(self, knobs: Knobs, server: ServerThread) -> None:
        self.knobs = knobs
        self.server = server
        self.url = server.url


@pytest.fixture
def fake_replicas() -> Iterator[Callable[..., list[Fake]]]:
    started: list[ServerThread] = []

    def make(n: int, **knobs: Any) -> list[Fake]:
        out = []
        for _ in range(n):
            k = Knobs(name=f"fake{len(started)}", **knobs)
            s = ServerThread(make_app(k), free_port()).start()
            started.append(s)
            out.append(Fake(k, s))
        return out

    yield make
    for s in started:
        s.stop()


@pytest.fixture
def router() -> Iterator[Callable[..., Any]]:
    """router(replica_urls, **config_sections) -> (url, Router) with fast health/scrape loops."""
    started: list[ServerThread] = []

    def make(urls: list[str], seed: int = 0, tokenizer: Any = None, listen_host: str = "127.0.0.1",
             **sections: Any) -> tuple[str, Any]:
        data: dict[str, Any] = {"replicas": [{"name": f"r{i}", "url": u} for i, u in enumerate(urls)],
                                "health": {"interval_s": 0.2, "scrape_interval_s": 0.1, "kv_events_interval_s": 0.1,
                                           "timeout_s": 2.0}}
        for k, v in sections.items():
            data[k] = {**data.get(k, {}), **v} if isinstance(v, dict) else v
        app = create_app(parse_config(data), tokenizer=tokenizer, seed=seed, listen_host=listen_host)
        s = ServerThread(app, free_port()).start()
        started.append(s)
        return s.url, app.state.router

    yield make
    for s in started:
        s.stop()

