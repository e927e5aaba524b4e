"""Importing this package fills the lowering table (see registry.py)."""

from torchbridge.device.lowerings import (
    attention,  # noqa: F401
    core,  # noqa: F401
    creation,  # noqa: F401
    distance,  # noqa: F401
    elementwise,  # noqa: F401
    embedding_bag,  # noqa: F401
    foreach,  # noqa: F401
    grid_sampler,  # noqa: F401
    histogram,  # noqa: F401
    householder,  # noqa: F401
    indexing,  # noqa: F401
    linalg,  # noqa: F401
    linalg_eig,  # noqa: F401
    linalg_lstsq,  # noqa: F401
    margin_loss,  # noqa: F401
    moe,  # noqa: F401
    nn,  # noqa: F401
    nonzero_static,  # noqa: F401
    prims,  # noqa: F401
    random,  # noqa: F401
    reduction,  # noqa: F401
    segment_reduce,  # noqa: F401
    special_functions,  # noqa: F401
    upsample_bicubic,  # noqa: F401
    view_ops,  # noqa: F401
)
