"""Router configuration: YAML -> validated `RouterConfig` (pydantic section models, unknown keys
rejected), with errors that name the bad key.

    router:       {block_size, session_header, profile_header, default_profile, retries,
                   request_timeout_s, connect_timeout_s, admin_token, max_sessions,
                   max_request_bytes}
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
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .scorers import (
    FILTERS,
    PICKERS,
    SCORERS,
    ConfigError,
    Filter,
    Picker,
    Scorer,
    build_plugin,
    check_params,
)

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


class _Section(BaseModel):
    # Unknown keys are errors (a typo must not silently fall back to a default); types are strict
    # (no "16" for 16, no true for 1), except that an int is a fine float.
    model_config = ConfigDict(extra="forbid", strict=True)


class RouterSection(_Section):
    block_size: int = Field(16, ge=1)
    session_header: str = "x-session-id"
    profile_header: str = "x-route-profile"
    default_profile: str = "sticky"
    retries: int = Field(2, ge=0)
    request_timeout_s: float = 600.0
    connect_timeout_s: float = 10.0
    # Bearer token for /admin/*; without one the admin API answers only on a loopback address.
    admin_token: str | None = None
    max_sessions: int = Field(100_000, ge=1)  # session-affinity entries kept (least recently used forgotten)
    max_request_bytes: int = Field(16 * 2**20, ge=1)  # larger bodies: 413 before they are read


class TokenizerSection(_Section):
    model_dir: str | None = None
    chars_per_token: int = Field(4, ge=1)


class FlowControlSection(_Section):
    max_inflight: int = Field(256, ge=1)
    max_queue: int = Field(1024, ge=0)
    queue_timeout_s: float = 60.0


class HealthSection(_Section):
    interval_s: float = Field(2.0, ge=1e-3)
    timeout_s: float = 2.0
    scrape_interval_s: float = Field(1.0, ge=1e-3)
    kv_events: bool = True
    kv_events_interval_s: float = 0.5
    default_kv_blocks: int = 4096
    default_prefill_tps: float = Field(2000.0, ge=1e-3)


class DiscoverySection(_Section):
    dns: str | None = None
    port: int = Field(8000, ge=1)
    interval_s: float = Field(10.0, ge=1e-3)
    scheme: Literal["http", "https"] = "http"


class ConfigFile(_Section):
    """The router YAML. Replicas and profiles are checked by parse_config and the plugins themselves
    (a plugin's parameters are its constructor's)."""

    router: RouterSection = RouterSection()
    tokenizer: TokenizerSection = TokenizerSection()
    flow_control: FlowControlSection = FlowControlSection()
    health: HealthSection = HealthSection()
    discovery: DiscoverySection = DiscoverySection()
    replicas: Any = None
    profiles: Any = None


_SECTIONS = ("router", "tokenizer", "flow_control", "health", "discovery")


@dataclass
class RouterConfig:
    """The validated config, flattened (discovery keys prefixed `discovery_`); the defaults live in the
    section models above."""

    block_size: int
    session_header: str
    profile_header: str
    default_profile: str
    retries: int
    request_timeout_s: float
    connect_timeout_s: float
    admin_token: str | None
    max_sessions: int
    max_request_bytes: int
    model_dir: str | None
    chars_per_token: int
    max_inflight: int
    max_queue: int
    queue_timeout_s: float
    interval_s: float
    timeout_s: float
    scrape_interval_s: float
    kv_events: bool
    kv_events_interval_s: float
    default_kv_blocks: int
    default_prefill_tps: float
    discovery_dns: str | None
    discovery_port: int
    discovery_interval_s: float
    discovery_scheme: str
    replicas: list[ReplicaSpec] = field(default_factory=list)
    profiles: dict[str, dict[str, Any]] = field(default_factory=lambda: copy.deepcopy(BUILTIN_PROFILES))
    source: str | None = None

    @classmethod
    def from_file(cls, f: ConfigFile, source: str | None = None) -> RouterConfig:
        flat: dict[str, Any] = {}
        for section in _SECTIONS:
            model = getattr(f, section)
            prefix = "discovery_" if section == "discovery" else ""  # keys repeat across sections
            for k, v in model.model_dump().items():
                is_float = type(model).model_fields[k].annotation is float
                flat[prefix + k] = float(v) if is_float else v
        return cls(**flat, source=source)


def _config_error(e: ValidationError) -> ConfigError:
    """The first pydantic error as `path: message`, the path naming the offending key."""
    err = e.errors()[0]
    loc = [str(x) for x in err["loc"]]
    typ, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if typ == "extra_forbidden" and len(loc) == 1:
        return ConfigError(f"<root>: unknown section(s) {loc}; allowed: {sorted([*_SECTIONS, 'replicas', 'profiles'])}")
    path = ".".join(loc)
    if typ == "extra_forbidden":
        section = ConfigFile.model_fields[loc[0]].annotation
        return ConfigError(f"{path}: unknown key; allowed: {sorted(section.model_fields)}")  # type: ignore[union-attr]
    expected = {"int_type": "int", "float_type": "float", "string_type": "str", "bool_type": "bool",
                "model_type": "a mapping", "literal_error": f"one of {ctx.get('expected')}"}
    if typ in expected:
        return ConfigError(f"{path}: expected {expected[typ]}, got {value!r}")
    if typ == "greater_than_equal":
        return ConfigError(f"{path}: must be >= {ctx['ge']}, got {value}")
    return ConfigError(f"{path}: {err['msg']}")


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
        check_params(sp, {"weight": w}, {"weight": (int, float)})
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
    # An empty YAML section (`router:`) means its defaults.
    data = {k: ({} if v is None and k in _SECTIONS else v) for k, v in data.items()}
    try:
        cfg = RouterConfig.from_file(ConfigFile.model_validate(data), source)
    except ValidationError as e:
        raise _config_error(e) from None
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
