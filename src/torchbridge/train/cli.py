"""`python -m torchbridge train [--config FILE.toml] [--device cpu|tpu] [--nproc N] [--steps N] [--out DIR]`.

Everything that can be wrong with a job is found here, before any rank starts: the config is parsed
and validated (a ConfigError names the key), the corpus is read and the tokenizer trained (OUT/data).
Then one rank runs in this process, or `--nproc N` ranks start through torchrun's machinery
(torch.distributed.launcher.api.elastic_launch: a c10d rendezvous on 127.0.0.1, no restarts; a rank
that fails stops the job). On the bridge's device each rank computes on one emulated chip.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import uuid
from pathlib import Path
from typing import Any

from torchbridge.train import config as config_lib
from torchbridge.train.config import ConfigError, TrainConfig


def parse(argv: list[str]) -> TrainConfig:
    parser = argparse.ArgumentParser(prog="torchbridge train", description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None,
                        help="a TOML file, or a shipped config's name (default: 'default', the bundled model's recipe)")
    parser.add_argument("--device", default=None, help="cpu or tpu (config: job.device)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks on this machine (config: job.nproc)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (config: training.steps)")
    parser.add_argument("--out", default=None, help="output directory (config: job.out)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override any key, e.g. --set parallel.tp=2 --set training.compile=true (TOML values)")
    args = parser.parse_args(argv)
    cfg = config_lib.load(args.config)
    overrides: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(key or "--set", "expected KEY=VALUE")
        overrides[key.strip()] = _toml_value(key.strip(), value.strip())
    for key, value in (("job.device", args.device), ("job.nproc", args.nproc), ("training.steps", args.steps),
                       ("job.out", args.out)):
        if value is not None:
            overrides[key] = value
    return config_lib.validate(config_lib.apply_overrides(cfg, overrides))


def _toml_value(key: str, text: str) -> Any:
    import tomllib

    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        if text and text[0] not in "[{\"'":
            return text  # a bare word is a string
        raise ConfigError(key, f"not a TOML value: {text}") from None


def launch(cfg: TrainConfig, config_path: Path) -> None:
    """Start job.nproc ranks of the trainer with torchrun's launcher; raises if a rank fails."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    port = cfg.job.port or _free_port()
    launch_cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=cfg.job.nproc, run_id=uuid.uuid4().hex,
                              rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=0,
                              monitor_interval=0.5, local_addr="127.0.0.1", start_method="spawn")
    elastic_launch(launch_cfg, entrypoint=sys.executable)("-m", "torchbridge.train.trainer", str(config_path))


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = parse(list(sys.argv[1:] if argv is None else argv))
    except ConfigError as e:
        print(f"torchbridge train: bad config: {e}", file=sys.stderr)
        return 2
    out = Path(cfg.job.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.job.nproc > 1:
        # the ranks inherit this environment: on JAX's CPU platform, as many emulated chips per process as
        # ranks (what torchrun jobs of the distributed tests use), and the cores shared between the ranks
        flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={cfg.job.nproc}".strip()
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // cfg.job.nproc)))
    from torchbridge.train import data

    try:
        data.prepare(cfg.data, cfg.training.seed, out)
    except ConfigError as e:
        print(f"torchbridge train: bad config: {e}", file=sys.stderr)
        return 2
    config_path = out / "config.json"
    config_path.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    if cfg.job.nproc == 1:
        from torchbridge.train import trainer

        trainer.run(cfg)
    else:
        launch(cfg, config_path)
    print(f"torchbridge train: done; outputs in {out}", file=sys.stderr)
    return 0
