"""Helpers of the trainer's tests: the tiny config, its data prepared once, runs in this process or through
`python -m torchbridge train` (bounded, its process group killed at the end)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

from distributed.launch import PORTS, run_bounded
from torchbridge.train import config as config_lib
from torchbridge.train import data


def tiny(out: Path, **overrides: Any) -> config_lib.TrainConfig:
    """The shipped tiny config with dotted-key overrides, validated; its output in `out`."""
    cfg = config_lib.load("tiny")
    return config_lib.validate(config_lib.apply_overrides(cfg, {"job.out": str(out), **overrides}))


def with_data(out: Path, prepared: Path) -> Path:
    """`out` holding a copy of the tiny config's prepared data (tokenizer, streams), so jobs skip preparing it."""
    out.mkdir(parents=True, exist_ok=True)
    shutil.copytree(prepared / data.DATA_DIR, out / data.DATA_DIR, dirs_exist_ok=True)
    return out


def run_here(out: Path, **overrides: Any) -> dict[str, Any]:
    """One rank of the trainer in this process; returns its summary (losses keyed by step, as ints)."""
    from torchbridge.train import trainer

    cfg = tiny(out, **overrides)
    data.prepare(cfg.data, cfg.training.seed, out)
    trainer.run(cfg)
    return summary(out)


def run_cli(out: Path, nproc: int, device: str, port_offset: int, args: list[str] | None = None,
            timeout: float = 500) -> dict[str, Any]:
    """`python -m torchbridge train --config tiny` on `nproc` ranks; returns rank 0's summary."""
    cmd = [sys.executable, "-m", "torchbridge", "train", "--config", "tiny", "--device", device,
           "--nproc", str(nproc), "--out", str(out), "--set", f"job.port={PORTS['train'] + port_offset}",
           *(args or [])]
    env = {**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR", "TORCHBRIDGE_COMPILE_CACHE_MIN_SECS": "0"}
    run_bounded(cmd, env, timeout, f"train on {nproc} ranks ({device})")
    return summary(out)


def summary(out: Path) -> dict[str, Any]:
    s = json.loads((out / "summary.json").read_text())
    s["losses"] = {int(k): v for k, v in s["losses"].items()}
    return s
