"""Deployment artefacts: Kubernetes manifests (schema-validated), the Ray Serve app, `up`."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from torchbridge.route.cli import free_port
from torchbridge.route.config import parse_config

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
FAKE = Path(__file__).resolve().parent / "fake_replica.py"


def _docs() -> list[dict]:
    out = []
    for f in sorted(K8S.glob("*.yaml")):
        out += [d for d in yaml.safe_load_all(f.read_text()) if d]
    return out


def test_manifests_validate_against_kubernetes_schema() -> None:
    import kubernetes_validate

    docs = _docs()
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in docs)
    assert kinds == [("ConfigMap", "torchbridge-router"), ("Deployment", "torchbridge-engine"),
                     ("Deployment", "torchbridge-router"), ("Service", "torchbridge-engine"),
                     ("Service", "torchbridge-router")]
    version = kubernetes_validate.latest_version()
    for d in docs:
        kubernetes_validate.validate(d, version, strict=True)  # raises on any schema violation


def test_schema_checker_rejects_a_broken_manifest() -> None:
    import kubernetes_validate

    bad = next(d for d in _docs() if d["kind"] == "Deployment")
    bad["spec"]["replicas"] = "four"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kubernetes_validate.latest_version(), strict=True)


def test_manifests_are_consistent() -> None:
    docs = {(d["kind"], d["metadata"]["name"]): d for d in _docs()}
    cfg = parse_config(yaml.safe_load(docs[("ConfigMap", "torchbridge-router")]["data"]["router.yaml"]))
    engine_svc = docs[("Service", "torchbridge-engine")]
    assert engine_svc["spec"]["clusterIP"] == "None"  # headless: the router needs pod addresses
    assert cfg.discovery_dns is not None and cfg.discovery_dns.split(".")[0] == "torchbridge-engine"
    assert cfg.discovery_port == engine_svc["spec"]["ports"][0]["port"]
    for name in ("torchbridge-engine", "torchbridge-router"):
        dep, svc = docs[("Deployment", name)], docs[("Service", name)]
        assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    router_args = docs[("Deployment", "torchbridge-router")]["spec"]["template"]["spec"]["containers"][0]["args"]
    mount = docs[("Deployment", "torchbridge-router")]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    assert router_args[router_args.index("--config") + 1].startswith(
        next(m["mountPath"] for m in mount if m["name"] == "config"))


def test_dns_discovery_adds_replicas(fake_replicas, router) -> None:
    import asyncio

    (f,) = fake_replicas(1)
    port = int(f.url.rsplit(":", 1)[1])
    url, r = router([], discovery={"dns": "localhost", "port": port, "interval_s": 0.2})
    from route_support import wait_for

    wait_for(lambda: any(n.startswith("dns:127.0.0.1:") for n in r.pool.replicas), what="discovered replica")
    resp = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert resp.status_code == 200 and resp.headers["x-torchbridge-replica"] == f"dns:127.0.0.1:{port}"
    assert asyncio.run(_no_change(r)) == ([], [])


async def _no_change(r):  # noqa: ANN001, ANN202
    return await r.pool.discover()


def test_route_cli_rejects_bad_config(tmp_path: Path) -> None:
    p = tmp_path / "r.yaml"
    p.write_text("router: {block_size: 0}\n")
    env = {**os.environ, "TORCHBRIDGE_NO_DEVICE": "1"}
    out = subprocess.run([sys.executable, "-m", "torchbridge", "route", "--config", str(p)], capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.returncode == 2 and "router.block_size: must be >= 1" in out.stderr


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_up_starts_replicas_and_router_and_cleans_up(tmp_path: Path, sig: int) -> None:
    port = free_port()
    env = {**os.environ, "TORCHBRIDGE_NO_DEVICE": "1", "TORCHBRIDGE_UP_LOGS": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "torchbridge", "up", "--replicas", "2", "--router-port", str(port),
         "--engine-cmd", f"{sys.executable} {FAKE} --port {{port}}", "--profile", "round-robin"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "Ctrl-C" in line:
                break
        text = "".join(lines)
        assert text.count("healthy") == 3, text  # two engines and the router
        url = f"http://127.0.0.1:{port}"
        served = {httpx.post(url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2}, timeout=30)
                  .headers["x-torchbridge-replica"] for i in range(4)}
        assert served == {"r0", "r1"}
        engine_ports = [int(line.split()[2].rsplit(":", 1)[1]) for line in lines if line.startswith("engine")]
    finally:
        proc.send_signal(sig)
        rc = proc.wait(timeout=30)
    assert rc == 0
    assert "shutting down" in proc.stdout.read()
    for p in [port, *engine_ports]:  # everything it started is gone
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{p}/health", timeout=2)


@pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                    reason="ray is not installed (pip install 'ray[serve]'); the Ray Serve app is untested here")
def test_ray_serve_app_routes_across_engine_actors() -> None:
    import ray
    from ray import serve

    from torchbridge.route.ray_app import build_app

    http_port = free_port()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"TORCHBRIDGE_NO_DEVICE": "1", "TORCHBRIDGE_RAY_LOCAL": "1"}})
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": http_port})
        app = build_app({"replicas": 2, "engine_cmd": f"{sys.executable} {FAKE} --port {{port}}",
                         "engine_num_cpus": 0.5, "router_num_cpus": 0.5,
                         "router": {"router": {"default_profile": "round-robin"}}})
        serve.run(app, name="torchbridge", route_prefix="/")
        url = f"http://127.0.0.1:{http_port}"
        served = set()
        for i in range(4):
            r = httpx.post(url + "/v1/completions", json={"prompt": f"ray {i}", "max_tokens": 3}, timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == " t0 t1 t2"
            served.add(r.headers["x-torchbridge-replica"])
        assert served == {"engine0", "engine1"}
    finally:
        serve.shutdown()
        ray.shutdown()
