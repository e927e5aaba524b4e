"""Run engines + router on a local Ray instance: python deploy/ray/run_local.py --replicas 2 [--model DIR]."""

from __future__ import annotations

import argparse
import time

import ray
from ray import serve

from torchbridge.route.ray_app import build_app


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--model")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--num-cpus", type=int, default=None)
    a = ap.parse_args()
    ray.init(num_cpus=a.num_cpus, runtime_env={"env_vars": {"TORCHBRIDGE_NO_DEVICE": "1"}})
    serve.start(http_options={"host": "127.0.0.1", "port": a.port})
    serve.run(build_app({"replicas": a.replicas, **({"model": a.model} if a.model else {})}),
              name="torchbridge", route_prefix="/")
    print(f"router on http://127.0.0.1:{a.port}/v1 (Ctrl-C to stop)")
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
