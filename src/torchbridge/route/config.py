"""Router configuration: YAML -> validated `RouterConfig`, with errors that name the bad key.

    router:       {block_size, session_header, profile_header, default_profile, retries,
                   request_timeout_s, connect_timeout_s, admin_token}
    tokenizer:    {model_dir, chars_per_token}
    flow_control: {max_inflight, max_queue, queue_timeout_s}
    health:       {interval_s, timeout_s, scrape_interval_s, kv_events, kv_events_interval_s,
                   default_kv_blocks, default_prefill_tps}
    discovery:    {dns, port, interval_s, scheme}  (replicas = the A records of `dns`, e.g. a
                   Kubernetes headless Service; added and removed as the records change)
    replicas:     [{name, url}]
    profiles:     {NAME: {filters: [...], scorers: [{type, weight, ...}], picker: {type, ...}}}

Profiles named here replace built-in ones of the same name; the built-ins (the benchmark arms)
are always available otherwise.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .scorers import FILTERS, PICKERS, SCORERS, ConfigError, Filter, Picker, Scorer, build_plugin

__all__ = ["ConfigError", "Profile", "ReplicaSpec", "RouterConfig", "BUILTIN_PROFILES", "load_config",
           "parse_config", "build_profile"]

BUILTIN_PROFILES: dict[str, dict[str, Any]] = {
    "round-robin": {"picker": {"type": "round-robin"}},
    "random": {"picker": {"type": "random"}},
    "least-loaded": {"picker": {"type": "least-loaded"}},
    # llm-d-style: prefix affinity traded off against load scorers. Load weights sum above the
    # prefix weight so one warm replica cannot attract a herd of cold requests; `load` counts
    # decoding requests too, which `inflight-tokens` (prefill backlog) does not see.
    "prefix-aware": {
        "filters": [{"type": "kv-headroom", "max_usage": 0.98}],
        "scorers": [
            {"type": "prefix-cache", "weight": 1.0},
            {"type": "inflight-tokens", "weight": 0.5},
            {"type": "load", "weight": 0.5},
            {"type": "kv-cache-utilization", "weight": 0.3},
        ],
        "picker": {"type": "max-score"},
    },
    "sticky": {
        "scorers": [
            {"type": "prefix-cache", "weight": 1.0},
            {"type": "session-affinity", "weight": 0.3},
            {"type": "inflight-tokens", "weight": 0.5},
            {"type": "load", "weight": 0.5},
        ],
        "picker": {"type": "sticky-until-saturated", "hit_threshold": 0.8, "max_extra_wait_s": 0.5},
    },
}


@dataclass
class ReplicaSpec:
    name: str
    url: str


@dataclass
class Profile:
    name: str
    filters: list[Filter]
    scorers: list[tuple[Scorer, float]]
    picker: Picker


_SECTIONS: dict[str, dict[str, tuple[type | tuple[type, ...], Any]]] = {
    "router": {
        "block_size": (int, 16),
        "session_header": (str, "x-session-id"),
        "profile_header": (str, "x-route-profile"),
        "default_profile": (str, "sticky"),
        "retries": (int, 2),
        "request_timeout_s": ((int, float), 600.0),
        "connect_timeout_s": ((int, float), 10.0),
        "admin_token": ((str, type(None)), None),
        "max_sessions": (int, 100_000),
    },
    "tokenizer": {
        "model_dir": ((str, type(None)), None),
        "chars_per_token": (int, 4),
    },
    "flow_control": {
        "max_inflight": (int, 256),
        "max_queue": (int, 1024),
        "queue_timeout_s": ((int, float), 60.0),
    },
    "health": {
        "interval_s": ((int, float), 2.0),
        "timeout_s": ((int, float), 2.0),
        "scrape_interval_s": ((int, float), 1.0),
        "kv_events": (bool, True),
        "kv_events_interval_s": ((int, float), 0.5),
        "default_kv_blocks": (int, 4096),
        "default_prefill_tps": ((int, float), 2000.0),
    },
    "discovery": {
        "dns": ((str, type(None)), None),
        "port": (int, 8000),
        "interval_s": ((int, float), 10.0),
        "scheme": (str, "http"),
    },
}


@dataclass
class RouterConfig:
    block_size: int = 16
    session_header: str = "x-session-id"
    profile_header: str = "x-route-profile"
    default_profile: str = "sticky"
    retries: int = 2
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    # Bearer token for /admin/*; without one the admin API answers only on a loopback address.
    admin_token: str | None = None
    max_sessions: int = 100_000  # session-affinity entries kept (least recently used forgotten)
    model_dir: str | None = None
    chars_per_token: int = 4
    max_inflight: int = 256
    max_queue: int = 1024
    queue_timeout_s: float = 60.0
    interval_s: float = 2.0
    timeout_s: float = 2.0
    scrape_interval_s: float = 1.0
    kv_events: bool = True
    kv_events_interval_s: float = 0.5
    default_kv_blocks: int = 4096
    default_prefill_tps: float = 2000.0
    discovery_dns: str | None = None
    discovery_port: int = 8000
    discovery_interval_s: float = 10.0
    discovery_scheme: str = "http"
    replicas: list[ReplicaSpec] = field(default_factory=list)
    profiles: dict[str, dict[str, Any]] = field(default_factory=lambda: copy.deepcopy(BUILTIN_PROFILES))
    source: str | None = None


def _check_type(path: str, value: Any, t: type | tuple[type, ...]) -> None:
    numeric = t in (int, float, (int, float))
    if (isinstance(value, bool) and numeric) or not isinstance(value, t):
        name = " or ".join(x.__name__ for x in (t if isinstance(t, tuple) else (t,)))
        raise ConfigError(f"{path}: expected {name}, got {value!r}")


def build_profile(name: str, spec: Any, path: str | None = None) -> Profile:
    """Fresh plugin instances for a profile spec (pickers such as round-robin carry state, so each
    router builds its own)."""
    path = path or f"profiles.{name}"
    if not isinstance(spec, dict):
        raise ConfigError(f"{path}: expected a mapping, got {spec!r}")
    unknown = set(spec) - {"filters", "scorers", "picker"}
    if unknown:
        raise ConfigError(f"{path}: unknown key(s) {sorted(unknown)}; allowed: filters, scorers, picker")
    filters_spec = spec.get("filters") or []
    scorers_spec = spec.get("scorers") or []
    if not isinstance(filters_spec, list):
        raise ConfigError(f"{path}.filters: expected a list, got {filters_spec!r}")
    if not isinstance(scorers_spec, list):
        raise ConfigError(f"{path}.scorers: expected a list, got {scorers_spec!r}")
    filters = [build_plugin("filter", FILTERS, f"{path}.filters[{i}]", f) for i, f in enumerate(filters_spec)]
    scorers: list[tuple[Scorer, float]] = []
    for i, s in enumerate(scorers_spec):
        sp = f"{path}.scorers[{i}]"
        if not isinstance(s, dict):
            raise ConfigError(f"{sp}: expected a mapping with 'type' and 'weight', got {s!r}")
        w = s.get("weight", 1.0)
        _check_type(f"{sp}.weight", w, (int, float))
        if not 0.0 <= w <= 1.0:
            raise ConfigError(f"{sp}.weight: must be in [0, 1], got {w}")
        scorers.append((build_plugin("scorer", SCORERS, sp, s, extra_keys=("weight",)), float(w)))
    if "picker" not in spec:
        raise ConfigError(f"{path}.picker: missing (one of {sorted(PICKERS)})")
    picker = build_plugin("picker", PICKERS, f"{path}.picker", spec["picker"])
    return Profile(name, filters, scorers, picker)


def parse_config(data: Any, source: str | None = None) -> RouterConfig:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"<root>: expected a mapping, got {type(data).__name__}")
    unknown = set(data) - set(_SECTIONS) - {"replicas", "profiles"}
    if unknown:
        raise ConfigError(f"<root>: unknown section(s) {sorted(unknown)}; "
                          f"allowed: {sorted([*_SECTIONS, 'replicas', 'profiles'])}")
    cfg = RouterConfig(source=source)
    for section, keys in _SECTIONS.items():
        sec = data.get(section) or {}
        if not isinstance(sec, dict):
            raise ConfigError(f"{section}: expected a mapping, got {sec!r}")
        for k, v in sec.items():
            if k not in keys:
                raise ConfigError(f"{section}.{k}: unknown key; allowed: {sorted(keys)}")
            _check_type(f"{section}.{k}", v, keys[k][0])
            attr = f"discovery_{k}" if section == "discovery" else k  # keys repeat across sections
            setattr(cfg, attr, float(v) if keys[k][0] == (int, float) else v)
    for path, v, lo in (("router.block_size", cfg.block_size, 1), ("router.retries", cfg.retries, 0),
                        ("tokenizer.chars_per_token", cfg.chars_per_token, 1),
                        ("flow_control.max_inflight", cfg.max_inflight, 1),
                        ("flow_control.max_queue", cfg.max_queue, 0),
                        ("health.interval_s", cfg.interval_s, 1e-3),
                        ("health.scrape_interval_s", cfg.scrape_interval_s, 1e-3),
                        ("health.default_prefill_tps", cfg.default_prefill_tps, 1e-3),
                        ("discovery.interval_s", cfg.discovery_interval_s, 1e-3),
                        ("discovery.port", cfg.discovery_port, 1)):
        if v < lo:
            raise ConfigError(f"{path}: must be >= {lo}, got {v}")

    if cfg.discovery_scheme not in ("http", "https"):
        raise ConfigError(f"discovery.scheme: must be http or https, got {cfg.discovery_scheme!r}")
    reps = data.get("replicas") or []
    if not isinstance(reps, list):
        raise ConfigError(f"replicas: expected a list, got {reps!r}")
    seen: set[str] = set()
    for i, r in enumerate(reps):
        if isinstance(r, str):
            r = {"url": r}
        if not isinstance(r, dict) or "url" not in r:
            raise ConfigError(f"replicas[{i}]: expected a mapping with 'url' (and optional 'name'), got {r!r}")
        extra = set(r) - {"name", "url"}
        if extra:
            raise ConfigError(f"replicas[{i}]: unknown key(s) {sorted(extra)}")
        url = str(r["url"]).rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"replicas[{i}].url: must start with http:// or https://, got {url!r}")
        name = str(r.get("name") or f"r{i}")
        if name in seen:
            raise ConfigError(f"replicas[{i}].name: duplicate replica name {name!r}")
        seen.add(name)
        cfg.replicas.append(ReplicaSpec(name, url))

    profs = data.get("profiles") or {}
    if not isinstance(profs, dict):
        raise ConfigError(f"profiles: expected a mapping of name -> profile, got {profs!r}")
    for name, spec in profs.items():
        build_profile(str(name), spec)  # validate now, so a bad config fails at load time
        cfg.profiles[str(name)] = spec
    if cfg.default_profile not in cfg.profiles:
        raise ConfigError(f"router.default_profile: unknown profile {cfg.default_profile!r}; "
                          f"known: {sorted(cfg.profiles)}")
    return cfg


def load_config(path: str | Path) -> RouterConfig:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{p}: cannot read config: {e}") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: invalid YAML: {e}") from e
    try:
        return parse_config(data, source=str(p))
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from e
