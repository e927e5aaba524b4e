"""The eager-mode counters that torchbridge.metrics() reports."""

from __future__ import annotations

from typing import Any

from torchbridge.device import dispatch, eager_mode, fused, native, recycling
from torchbridge.device.runtime import STATE


def metrics() -> dict[str, Any]:
    info = dispatch.cache_info()
    return {
        "eager_mode": eager_mode.mode(),
        "fused": fused.stats(),
        "compiled_programs": info["programs"],
        "compiles": info["compiles"],
        "compiles_by_op": dict(dispatch.compile_counter),
        "fast_path_entries": info["fast_entries"],
        "fast_path_hits": native.load().fast_hits(),
        "donated_writes": info["donated_writes"],
        "recycled_outputs": recycling.COUNTERS["recycled_outputs"],
        "cpu_fallbacks": dict(dispatch.cpu_fallback_counter),
        "live_storages": len(STATE.table),
    }
