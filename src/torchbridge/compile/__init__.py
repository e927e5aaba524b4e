"""torch.compile backend: `torch.compile(model, backend="tpu")`.

The names below load compile/backend.py (and with it Dynamo, ~2 s) on first use only: `import torch`
registers the device and its c10d backend, which import compile/spmd.py and compile/default_backend.py
from this package, and a process that never compiles (torchrun's launcher, a CPU reference job) should
not pay for Dynamo. Dynamo finds the backend itself through the `torch_dynamo_backends` entry point.
"""

from __future__ import annotations

from typing import Any

__all__ = ["bucket", "compile_graph", "metrics", "pad_to_bucket", "recompiles_expected", "tpu_backend"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from torchbridge.compile import backend

        return getattr(backend, name)
    raise AttributeError(f"module 'torchbridge.compile' has no attribute '{name}'")
