"""Old module names of the device package, kept as thin aliases of the modules that replaced them."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any


def forward(old: str, *new: str) -> Callable[[str], Any]:
    """A module `__getattr__` for `old` that finds each name in the `new` modules, with a DeprecationWarning."""

    def __getattr__(name: str) -> Any:
        for module in new:
            target = importlib.import_module(module)
            if hasattr(target, name):
                warnings.warn(f"{old} is deprecated: use {module}.{name}", DeprecationWarning, stacklevel=2)
                return getattr(target, name)
        raise AttributeError(f"module {old!r} has no attribute {name!r}")

    return __getattr__
