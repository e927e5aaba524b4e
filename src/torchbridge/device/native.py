"""Builds (once, cached) and loads the C++ half of the backend: allocator, hooks, guard, view kernels,
the eager cache key and fast path, the CPU platform's custom calls."""

from __future__ import annotations

import fcntl
import hashlib
import os
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
    import torch

    # The torch and JAX installations are part of the key, not only their versions: the build's command
    # line names their include and library directories, so two environments (the project's and a peer's
    # with its own copy of torch) sharing one build directory rebuilt it each time the other had built
    # last (~55 s per switch on 2 cores). The last part keeps these builds apart from older ones.
    text = (b"".join(p.read_bytes() for p in _SOURCES + _HEADERS) + torch.__version__.encode() + jax.__version__.encode()
            + str(Path(torch.__file__).resolve().parent).encode() + jax.ffi.include_dir().encode()
            + " ".join(_CFLAGS).encode() + b"sources copied into the cache")
    digest = hashlib.sha256(text).hexdigest()[:16]
    root = Path(os.environ.get("TORCHBRIDGE_CACHE", Path.home() / ".cache" / "torchbridge"))
    path = root / f"native-{digest}"
    (path / "csrc").mkdir(parents=True, exist_ok=True)
    # The build compiles a copy of the sources kept in the cache: two checkouts (or installs) with the same
    # sources share one build. Built from each checkout's own paths, ninja saw a changed command line each
    # time another one had built last and recompiled (80-210 s per switch with several worktrees).
    for src in _SOURCES + _HEADERS:
        copy = path / "csrc" / src.name
        if not copy.exists():
            tmp = copy.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(src.read_bytes())
            tmp.replace(copy)  # atomic: a concurrent process sees the whole file or none
    return path


def loaded() -> bool:
    return _module is not None


def load() -> ModuleType:
    """The compiled extension; the first call in a fresh cache compiles it (~25 s on 2 cores)."""
    global _module
    if _module is None:
        import jax
        from torch.utils.cpp_extension import load as cpp_load

        build = _build_dir()
        # PyTorch's build lock is a file that only its holder removes: a build killed half-way (a timeout,
        # Ctrl-C, an OOM kill) left it, and every later import waited for it forever. An flock is released
        # by the kernel when its holder dies; under it, a leftover PyTorch lock can only be stale.
        with open(build / "build.flock", "w") as held:
            fcntl.flock(held, fcntl.LOCK_EX)
            (build / "lock").unlink(missing_ok=True)
            _module = cpp_load(
                name="torchbridge_native",
                sources=[str(build / "csrc" / p.name) for p in _SOURCES],
                extra_include_paths=[jax.ffi.include_dir()],  # XLA's FFI headers, for the host GEMM
                build_directory=str(build),
                extra_cflags=_CFLAGS,
                verbose=os.environ.get("TORCHBRIDGE_VERBOSE_BUILD") == "1",
            )
    return _module
