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
