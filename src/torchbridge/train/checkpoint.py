"""Sharded checkpoints with torch.distributed.checkpoint, and exact resume.

A checkpoint is OUT/checkpoints/step-N: each rank writes its own shards of the model and the optimizer
state (FSDP2 / TP DTensors as they are), plus the LR scheduler's state and the step. Batches are a
function of (seed, step) (data.py), so the step is all the data loader needs: a job resumed from step N
computes exactly what the uninterrupted job computed after step N. A checkpoint is written to a
temporary directory and renamed when every rank has finished, so a job killed mid-write leaves no
half checkpoint behind for the next one to load.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

DIR = "checkpoints"
_STEP = re.compile(r"^step-(\d+)$")


def _state(model: nn.Module, optimizer: Any, scheduler: Any, step: int) -> dict[str, Any]:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": step}


def save(out: Path, step: int, model: nn.Module, optimizer: Any, scheduler: Any) -> Path:
    final = out / DIR / f"step-{step}"
    tmp = out / DIR / f".step-{step}.tmp"
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    dcp.save(_state(model, optimizer, scheduler, step), checkpoint_id=str(tmp))
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    dist.barrier()
    return final


def latest(out: Path) -> Path | None:
    """The newest complete checkpoint in OUT/checkpoints, if any."""
    found = [(int(m.group(1)), p) for p in (out / DIR).glob("step-*") if (m := _STEP.match(p.name)) and p.is_dir()]
    return max(found)[1] if found else None


def load(path: Path, model: nn.Module, optimizer: Any, scheduler: Any) -> int:
    """Load a checkpoint into the (already parallelized) model and optimizer; returns its step."""
    state = _state(model, optimizer, scheduler, 0)
    dcp.load(state, checkpoint_id=str(path))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])
