from __future__ import annotations

from pathlib import Path

import pytest

from torchbridge.route.config import BUILTIN_PROFILES, ConfigError, load_config, parse_config

GOOD = """
router:
  block_size: 32
  default_profile: mine
  retries: 1
tokenizer: {chars_per_token: 3}
flow_control: {max_inflight: 8, max_queue: 2}
health: {interval_s: 0.5, kv_events: false}
replicas:
  - {name: a, url: "http://10.0.0.1:8000/"}
  - http://10.0.0.2:8000
profiles:
  mine:
    filters: [{type: low-queue, max_queue: 4}]
    scorers:
      - {type: prefix-cache, weight: 0.7, index: approx}
      - {type: queue-depth, weight: 0.3}
    picker: {type: sticky-until-saturated, hit_threshold: 0.9, max_extra_wait_s: 2}
"""


def test_good_config(tmp_path: Path) -> None:
    p = tmp_path / "router.yaml"
    p.write_text(GOOD)
    cfg = load_config(p)
    assert cfg.block_size == 32 and cfg.retries == 1 and cfg.chars_per_token == 3
    assert cfg.max_inflight == 8 and cfg.max_queue == 2 and cfg.kv_events is False and cfg.interval_s == 0.5
    assert [(r.name, r.url) for r in cfg.replicas] == [("a", "http://10.0.0.1:8000"), ("r1", "http://10.0.0.2:8000")]
    assert cfg.default_profile == "mine"
    assert set(BUILTIN_PROFILES) <= set(cfg.profiles)  # built-ins stay available


def test_empty_config_has_defaults() -> None:
    cfg = parse_config(None)
    assert cfg.block_size == 16 and cfg.default_profile == "sticky" and cfg.replicas == []


@pytest.mark.parametrize("data,needle", [
    ({"router": {"block_size": 0}}, "router.block_size: must be >= 1"),
    ({"router": {"block_size": "16"}}, "router.block_size: expected int"),
    ({"router": {"retries": True}}, "router.retries: expected int"),
    ({"router": {"bogus": 1}}, "router.bogus: unknown key"),
    ({"routr": {}}, "unknown section(s) ['routr']"),
    ({"router": {"default_profile": "nope"}}, "router.default_profile: unknown profile 'nope'"),
    ({"replicas": [{"name": "a"}]}, "replicas[0]: expected a mapping with 'url'"),
    ({"replicas": ["ftp://x"]}, "replicas[0].url: must start with http://"),
    ({"replicas": [{"name": "a", "url": "http://x"}, {"name": "a", "url": "http://y"}]}, "duplicate replica name"),
    ({"profiles": {"p": {"picker": {"type": "best"}}}}, "profiles.p.picker.type: unknown picker 'best'"),
    ({"profiles": {"p": {"scorers": [{"type": "prefix-cache"}]}}}, "profiles.p.picker: missing"),
    ({"profiles": {"p": {"scorers": [{"type": "queue-depth", "weight": 2}], "picker": "max-score"}}},
     "profiles.p.scorers[0].weight: must be in [0, 1], got 2"),
    ({"profiles": {"p": {"scorers": [{"type": "queue-dept"}], "picker": "max-score"}}},
     "profiles.p.scorers[0].type: unknown scorer 'queue-dept'"),
    ({"profiles": {"p": {"scorers": [{"type": "prefix-cache", "idx": "x"}], "picker": "max-score"}}},
     "profiles.p.scorers[0]: unknown parameter(s) ['idx']"),
    ({"profiles": {"p": {"picker": {"type": "sticky-until-saturated", "hit_threshold": 1.5}}}},
     "profiles.p.picker.hit_threshold: must be in (0, 1]"),
    ({"profiles": {"p": {"picker": {"type": "sticky-until-saturated", "max_extra_wait_s": "x"}}}},
     "profiles.p.picker.max_extra_wait_s: expected"),
    ({"profiles": {"p": {"filters": [{"type": "kv-headroom", "max_usage": 3}], "picker": "random"}}},
     "profiles.p.filters[0].max_usage: must be in [0, 1]"),
    ({"profiles": {"p": {"picker": "random", "extra": 1}}}, "profiles.p: unknown key(s) ['extra']"),
    ({"health": {"kv_event": True}}, "health.kv_event: unknown key"),
    ({"flow_control": {"max_queue": -1}}, "flow_control.max_queue: must be >= 0"),
    ({"router": {"max_sessions": 0}}, "router.max_sessions: must be >= 1"),
    ({"router": "fast"}, "router: expected a mapping"),
    ({"discovery": {"scheme": "ftp"}}, "discovery.scheme: expected one of"),
    ({"router": {"admin_token": 123}}, "router.admin_token"),
])
def test_bad_config_names_the_key(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(data)
    assert needle in str(e.value)


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    p = tmp_path / "bad.yaml"
    p.write_text("router: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(p)
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    p.write_text("router: {block_size: -3}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml: router\.block_size"):
        load_config(p)
