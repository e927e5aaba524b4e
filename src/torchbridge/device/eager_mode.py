"""Which eager mode runs device ops: "eager" (one cached executable per op, the default) or "fused"
(each op is recorded and every recorded sequence runs as one executable, fused.py).

TORCHBRIDGE_EAGER_MODE sets the mode a process starts in; torchbridge.set_eager_mode switches it.
"""

from __future__ import annotations

import os

from torchbridge.device import native
from torchbridge.device.runtime import STATE

_mode = os.environ.get("TORCHBRIDGE_EAGER_MODE", "eager")


def mode() -> str:
    return _mode


def is_fused() -> bool:
    return _mode == "fused"


def set_mode(new: str) -> None:
    """'eager' (one executable per op) or 'fused' (record, then run sequences as one)."""
    global _mode
    if new not in ("eager", "fused"):
        raise ValueError(f"torchbridge: eager mode must be 'eager' or 'fused', not {new!r}")
    if _mode == "fused" and new != "fused":
        STATE.table.flush()  # what was recorded runs now, while the recorder still owns it
    _mode = new
    if native.loaded():  # the C++ fast path records instead of running, so the recorder sees every op
        native.load().fast_fused(new == "fused")
