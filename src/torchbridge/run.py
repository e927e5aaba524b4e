"""`make run` / `python -m torchbridge run`: the main job on the bundled default model.

Brings up a routed local cluster (engine replicas behind the cache-aware router), sends one demo
completion through the router so you can see the model answer, then keeps serving until Ctrl-C.
"""

from __future__ import annotations

import argparse
import threading
import time

import httpx


def _demo(url: str, model_timeout: float) -> None:
    deadline = time.monotonic() + model_timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        return
    # a tiny model left greedy repeats itself; vLLM's repetition_penalty keeps the demo readable
    prompt = "import os\n\n\ndef "
    try:
        models = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        body = {"model": models[0]["id"], "prompt": prompt, "max_tokens": 48, "temperature": 0,
                "repetition_penalty": 1.3}
        text = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        print(f"demo request failed: {e}", flush=True)
        return
    print(f"\n--- demo: POST {url}/v1/completions ---\n{prompt}{text}\n---\n"
          f"try: curl {url}/v1/completions -H 'content-type: application/json' "
          f"-d '{{\"model\": \"{models[0]['id']}\", \"prompt\": \"import os\\n\", \"max_tokens\": 32}}'\n", flush=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="torchbridge run", description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--device", default="cpu", help="engine device: cpu, cuda or tpu (the bridge)")
    ap.add_argument("--no-demo", action="store_true")
    args, rest = ap.parse_known_args(argv)
    from torchbridge.route.cli import up
    from torchbridge.serve import default_model_dir

    url = f"http://127.0.0.1:{args.port}"
    if not args.no_demo:
        threading.Thread(target=_demo, args=(url, 900.0), daemon=True).start()
    return up(["--replicas", str(args.replicas), "--router-port", str(args.port), "--device", args.device,
               "--model", str(default_model_dir()), *rest])
