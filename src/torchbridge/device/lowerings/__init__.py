"""Importing this package fills the lowering table (see registry.py)."""

from torchbridge.device.lowerings import (
    core,  # noqa: F401
    creation,  # noqa: F401
    elementwise,  # noqa: F401
    extra,  # noqa: F401
    foreach,  # noqa: F401
    indexing,  # noqa: F401
    linalg,  # noqa: F401
    nn,  # noqa: F401
    prims,  # noqa: F401
    random,  # noqa: F401
    reduction,  # noqa: F401
    view_ops,  # noqa: F401
)
