"""A Ray Serve application: N engine replicas as Ray actors plus the router as a Serve ingress.

    import ray
    from ray import serve
    from torchbridge.route.ray_app import build_app
    ray.init()
    serve.run(build_app({"replicas": 4, "model": "/models/default"}), route_prefix="/")

or `serve run torchbridge.route.ray_app:build_app replicas=4 model=/models/default`.

Each engine is a `torchbridge serve` subprocess owned by an `EngineReplica` actor (so Ray places
it on a node with the CPUs/GPUs it asks for and kills it with the actor); the router deployment
starts the actors, waits for them to be healthy and serves the ordinary router app over them,
so routing behaves exactly as under `torchbridge route`. Ray is imported lazily: the router
itself does not depend on it.
"""

from __future__ import annotations

import os
import sys
from typing import Any

ENGINE_CMD = "{python} -m torchbridge serve --device {device} --host {host} --port {port}"


class EngineProcess:
    """The body of the EngineReplica actor (a plain class so it is usable and testable without Ray)."""

    def __init__(self, cmd: str | None = None, model: str | None = None, device: str = "cpu",
                 extra_args: list[str] | None = None, timeout_s: float = 600.0) -> None:
        import subprocess

        from .cli import _wait_healthy, free_port

        host = "127.0.0.1" if os.environ.get("TORCHBRIDGE_RAY_LOCAL") else "0.0.0.0"
        port = free_port("0.0.0.0")
        template = cmd or ENGINE_CMD + (" --model {model}" if model else "")
        argv = template.format(python=sys.executable, device=device, host=host, port=port, model=model).split()
        argv += extra_args or []
        env = dict(os.environ)
        if device in ("cpu", "cuda"):  # these engines never need the bridge: skip loading it
            env["TORCHBRIDGE_NO_DEVICE"] = "1"
        else:
            env.pop("TORCHBRIDGE_NO_DEVICE", None)
        self.proc = subprocess.Popen(argv, env=env)
        node_ip = "127.0.0.1"
        try:
            import ray

            node_ip = ray.util.get_node_ip_address() if host != "127.0.0.1" else node_ip
        except Exception:  # noqa: BLE001 - outside Ray, loopback is right
            pass
        self.url = f"http://{node_ip}:{port}"
        if not _wait_healthy(f"http://127.0.0.1:{port}", self.proc, timeout_s):
            self.stop()
            raise RuntimeError(f"engine {argv} did not become healthy")

    def get_url(self) -> str:
        return self.url

    def stop(self) -> None:
        from .cli import _stop

        _stop([self.proc])

    def __del__(self) -> None:
        if getattr(self, "proc", None) is not None and self.proc.poll() is None:
            self.proc.kill()


def build_app(args: dict[str, Any]) -> Any:
    """Serve application builder. args: replicas (int), model, device, engine_cmd (template with
    {port}), engine_num_cpus, engine_num_gpus, router (a router YAML mapping, optional)."""
    import ray
    from ray import serve

    n = int(args.get("replicas", 2))
    engine_opts = {"num_cpus": float(args.get("engine_num_cpus", 1)), "num_gpus": float(args.get("engine_num_gpus", 0))}
    EngineReplica = ray.remote(**engine_opts)(EngineProcess)  # noqa: N806 - a class

    @serve.deployment(ray_actor_options={"num_cpus": float(args.get("router_num_cpus", 0.5))})
    @serve.ingress()
    class TorchbridgeRouter:
        def __init__(self) -> None:
            self.engines = [EngineReplica.remote(args.get("engine_cmd"), args.get("model"), args.get("device", "cpu"))
                            for _ in range(n)]
            self.urls = ray.get([e.get_url.remote() for e in self.engines])

        def __serve_build_asgi_app__(self) -> Any:
            from .config import parse_config
            from .proxy import create_app

            data = dict(args.get("router") or {})
            data["replicas"] = [*(data.get("replicas") or []),
                                *({"name": f"engine{i}", "url": u} for i, u in enumerate(self.urls))]
            if args.get("model"):
                data.setdefault("tokenizer", {})["model_dir"] = args["model"]
            return create_app(parse_config(data))

    return TorchbridgeRouter.bind()
