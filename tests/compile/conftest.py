"""Fixtures shared by the compile tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture
def fresh_dynamo() -> Iterator[None]:
    """Dynamo's caches emptied before and after a test: counts of graphs and compiles start from zero and
    one test's guards do not serve the next (files opt in with `pytest.mark.usefixtures`)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def no_program_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """Programs traced and compiled in this test, none loaded from (or kept in) compile/program_cache.py:
    for tests that watch a compile-time decision being made (a program kept by an earlier test would
    arrive decided), or that fake part of it (a faked decision must not be kept for later tests)."""
    from torchbridge.compile import program_cache

    monkeypatch.setattr(program_cache, "directory", lambda: None)
