"""Builds (once, cached) and loads the C++ half of the backend: allocator, hooks, guard, view kernels,
the eager cache key and fast path, the CPU platform's custom calls."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

_CSRC = Path(__file__).parent / "csrc"
_SOURCES = [_CSRC / name for name in ("native.cpp", "fast_path.cpp", "host_calls.cpp", "autocast.cpp")]
_HEADERS = [_CSRC / "native.h"]
# (-fno-math-errno: square roots need not set errno, so loops of them vectorise: the Adam step)
_CFLAGS = ["-O2", "-fno-math-errno"]
_module: ModuleType | None = None


def _build_dir() -> Path:
    import jax

    from torchbridge import cpp_build

    # The torch and JAX installations are part of the key, not only their versions (a peer venv with its
    # own torch sharing the cache rebuilt each time the other had built last: ~55 s per switch on 2 cores).
    key = cpp_build.torch_signature() + jax.__version__.encode() + jax.ffi.include_dir().encode() + " ".join(
        _CFLAGS).encode()
    return cpp_build.build_dir("native", _SOURCES + _HEADERS, key)


def loaded() -> bool:
    return _module is not None


def load() -> ModuleType:
    """The compiled extension; the first call in a fresh cache compiles it (~25 s on 2 cores)."""
    global _module
    if _module is None:
        import jax

        from torchbridge import cpp_build

        _module = cpp_build.load(
            "torchbridge_native", _build_dir(), [p.name for p in _SOURCES],
            extra_include_paths=[jax.ffi.include_dir()],  # XLA's FFI headers, for the host GEMM
            extra_cflags=_CFLAGS,
        )
    return _module
