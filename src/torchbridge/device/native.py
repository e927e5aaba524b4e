"""Builds (once, cached) and loads the C++ half of the backend: allocator, hooks, guard, view kernels."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import ModuleType

_SOURCE = Path(__file__).parent / "csrc" / "native.cpp"
_module: ModuleType | None = None


def _build_dir() -> Path:
    import torch

    digest = hashlib.sha256(_SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:16]
    root = Path(os.environ.get("TORCHBRIDGE_CACHE", Path.home() / ".cache" / "torchbridge"))
    path = root / f"native-{digest}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def loaded() -> bool:
    return _module is not None


def load() -> ModuleType:
    """The compiled extension; the first call in a fresh cache compiles it (~25 s on 2 cores)."""
    global _module
    if _module is None:
        from torch.utils.cpp_extension import load as cpp_load

        _module = cpp_load(
            name="torchbridge_native",
            sources=[str(_SOURCE)],
            build_directory=str(_build_dir()),
            extra_cflags=["-O2"],
            verbose=os.environ.get("TORCHBRIDGE_VERBOSE_BUILD") == "1",
        )
    return _module
