"""`python -m torchbridge {run,serve,route,up,train,doctor}`.

Each subcommand lives with the layer it belongs to; this file only dispatches, importing lazily so
that `route` never imports the engine and `serve --device cpu` never needs the bridge.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

_COMMANDS: dict[str, tuple[str, str, str]] = {
    # name: (module, function, help)
    "run": ("torchbridge.run", "main", "the main job: serve the bundled default model (what `make run` does)"),
    "serve": ("torchbridge.serve.cli", "main", "OpenAI-compatible LLM server on cpu, cuda or tpu"),
    "route": ("torchbridge.route.cli", "main", "cache-aware router in front of engine replicas"),
    "up": ("torchbridge.route.cli", "up", "start N engine replicas and the router on this machine"),
    "train": ("torchbridge.train.cli", "main", "train a Llama (FSDP2 / TP / 2-D) from a TOML config and export it"),
    "doctor": ("torchbridge.doctor", "main", "report torch, jax, the device backend and its platform"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="torchbridge", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=sorted(_COMMANDS), help="; ".join(f"{k}: {v[2]}" for k, v in _COMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0 if argv else 2
    ns, rest = parser.parse_known_args(argv[:1])
    module, func, _ = _COMMANDS[ns.command]
    if ns.command == "train":
        # a training step frees and re-allocates the same large buffers: keep them (host_allocator.py);
        # set before torch is imported, and inherited by the ranks torchrun starts
        os.environ.setdefault("TORCHBRIDGE_HOST_ALLOCATOR", "keep")
        from torchbridge import host_allocator

        host_allocator.configure()
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)
