"""Builds (once, cached) and loads the C++ half of the backend: allocator, hooks, guard, view kernels,
the eager cache key and fast path, the CPU platform's custom calls."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from types import ModuleType

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("native.cpp", "fast_path.cpp", "host_calls.cpp", "autocast.cpp")]
_HEADERS = [_CSRC / "native.h"]
_module: ModuleType | None = None


def _build_dir() -> Path:
    import jax
    import torch

    text = b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + torch.__version__.encode() + jax.__version__.encode()
    digest = hashlib.sha256(text).hexdigest()[:16]
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
        import jax
        from torch.utils.cpp_extension import load as cpp_load

        _module = cpp_load(
            name="torchbridge_native",
            sources=[str(p) for p in _SOURCES],
            extra_include_paths=[jax.ffi.include_dir()],  # XLA's FFI headers, for the host GEMM
            build_directory=str(_build_dir()),
            # (-fno-math-errno: square roots need not set errno, so loops of them vectorise: the Adam step)
            extra_cflags=["-O2", "-fno-math-errno"],
            verbose=os.environ.get("TORCHBRIDGE_VERBOSE_BUILD") == "1",
        )
    return _module
