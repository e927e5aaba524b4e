"""torch.compile backend: `torch.compile(model, backend="tpu")`."""

from torchbridge.compile.backend import (
    bucket,
    compile_graph,
    metrics,
    pad_to_bucket,
    recompiles_expected,
    tpu_backend,
)

__all__ = ["bucket", "compile_graph", "metrics", "pad_to_bucket", "recompiles_expected", "tpu_backend"]
