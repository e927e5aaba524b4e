"""Filters, scorers and pickers: the plugins a routing profile is assembled from, one per module
(base.py holds what they share). A profile names them by their `name`; `build_plugin` instantiates one
from its config entry, checking its parameters against the constructor's signature."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from .base import ConfigError, Filter, PickContext, Picker, RequestCtx, Scorer, check_params
from .inflight_tokens import InflightTokensScorer
from .kv_headroom import KVHeadroomFilter
from .kv_utilization import KVUtilizationScorer
from .least_loaded import LeastLoadedPicker
from .load import LoadScorer
from .low_queue import LowQueueFilter
from .max_score import MaxScorePicker
from .prefix_cache import PrefixCacheScorer
from .queue_depth import QueueDepthScorer
from .random_choice import RandomPicker
from .round_robin import RoundRobinPicker
from .running_requests import RunningRequestsScorer
from .session_affinity import SessionAffinityScorer
from .sticky_until_saturated import StickyUntilSaturatedPicker

__all__ = [
    "FILTERS", "PICKERS", "SCORERS", "ConfigError", "Filter", "InflightTokensScorer", "KVHeadroomFilter",
    "KVUtilizationScorer", "LeastLoadedPicker", "LoadScorer", "LowQueueFilter", "MaxScorePicker", "PickContext",
    "Picker", "PrefixCacheScorer", "QueueDepthScorer", "RandomPicker", "RequestCtx", "RoundRobinPicker",
    "RunningRequestsScorer", "Scorer", "SessionAffinityScorer", "StickyUntilSaturatedPicker", "build_plugin", "check_params",
]

FILTERS: dict[str, Callable[..., Filter]] = {c.name: c for c in (LowQueueFilter, KVHeadroomFilter)}
SCORERS: dict[str, Callable[..., Scorer]] = {c.name: c for c in (
    PrefixCacheScorer, QueueDepthScorer, RunningRequestsScorer, KVUtilizationScorer,
    InflightTokensScorer, LoadScorer, SessionAffinityScorer)}
PICKERS: dict[str, Callable[..., Picker]] = {c.name: c for c in (
    MaxScorePicker, RandomPicker, RoundRobinPicker, LeastLoadedPicker, StickyUntilSaturatedPicker)}


def build_plugin(kind: str, registry: dict[str, Callable[..., Any]], path: str, spec: Any,
                 extra_keys: tuple[str, ...] = ()) -> Any:
    """Instantiate `{type: name, **params}` from `registry`, with path-prefixed errors."""
    if isinstance(spec, str):
        spec = {"type": spec}
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: expected a mapping with 'type', got {spec!r}")
    typ = spec.get("type")
    if typ not in registry:
        raise ConfigError(f"{path}.type: unknown {kind} {typ!r}; known: {sorted(registry)}")
    params = {k: v for k, v in spec.items() if k != "type" and k not in extra_keys}
    cls = registry[typ]
    sig = inspect.signature(cls.__init__)
    allowed = {}
    for pname, p in list(sig.parameters.items())[2:]:  # skip self, path
        default = p.default
        allowed[pname] = (int, float) if isinstance(default, (int, float)) and not isinstance(default, bool) \
            else type(default)
    check_params(path, params, allowed)
    return cls(path, **params)
