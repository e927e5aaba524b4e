"""Builds a C++ extension once per set of sources and loads it (torch.utils.cpp_extension underneath).

Shared by the layers that ship C++ (the device's native half, the engine's CPU kernels); it imports
torch and nothing of torchbridge. A build lives in ~/.cache/torchbridge/<name>-<digest> (TORCHBRIDGE_CACHE
moves the root), the digest covering the sources, the flags and whatever else the caller says the
binary depends on. The sources are compiled from a copy kept in that directory: two checkouts with the
same sources share one build (built from each checkout's own paths, ninja saw a changed command line
whenever the other had built last, and recompiled).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType


def cache_root() -> Path:
    return Path(os.environ.get("TORCHBRIDGE_CACHE", Path.home() / ".cache" / "torchbridge"))


def build_dir(name: str, sources: Sequence[Path], key: bytes) -> Path:
    """The build directory for these sources (their copies placed in it); `key`: what else the build
    depends on (versions, include paths, flags, the CPU when compiled for it)."""
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sources) + key).hexdigest()[:16]
    path = cache_root() / f"{name}-{digest}"
    (path / "csrc").mkdir(parents=True, exist_ok=True)
    for src in sources:
        copy = path / "csrc" / src.name
        if not copy.exists():
            tmp = copy.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(src.read_bytes())
            tmp.replace(copy)  # atomic: a concurrent process sees the whole file or none
    return path


def load(name: str, build: Path, sources: Sequence[str], **kwargs: object) -> ModuleType | None:
    """torch.utils.cpp_extension.load of `sources` (names in build/csrc) into `build`, under a lock.

    PyTorch's own build lock is a file that only its holder removes: a build killed half-way (a timeout,
    Ctrl-C, an OOM kill) left it, and every later load waited for it forever. An flock is released by
    the kernel when its holder dies; under it, a leftover PyTorch lock can only be stale."""
    from torch.utils.cpp_extension import load as cpp_load

    with open(build / "build.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        (build / "lock").unlink(missing_ok=True)
        return cpp_load(name=name, sources=[str(build / "csrc" / s) for s in sources], build_directory=str(build),
                        verbose=os.environ.get("TORCHBRIDGE_VERBOSE_BUILD") == "1", **kwargs)


def torch_signature() -> bytes:
    """The torch installation a build compiles and links against: its version and its directory, not the
    version alone (the build's command line names its include and library directories, so an environment
    with its own copy of torch sharing the cache rebuilt each time the other had built last)."""
    import torch

    return torch.__version__.encode() + str(Path(torch.__file__).resolve().parent).encode()


def cpu_signature() -> bytes:
    """What -march=native compiles for: the CPU's model and feature flags (a cache shared by machines
    of another kind must not hand them a binary with instructions they lack)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor().encode() + platform.machine().encode()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({ln for ln in lines if ln.split(":")[0].strip() in wanted})).encode()
