"""Rank 1 dies (os._exit) after one all-reduce; rank 0 then calls another. argv: OUT.
Rank 0 writes OUT/rank0.json with the error it saw (or the value, if the collective wrongly completed)."""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

OUT = Path(sys.argv[1])
dist.init_process_group(timeout=timedelta(seconds=30))
RANK = dist.get_rank()
DEV = torch.device("tpu", int(os.environ.get("LOCAL_RANK", RANK)))
torch.tpu.set_device(DEV)
x = torch.ones(1024, device=DEV)
dist.all_reduce(x)
assert x[0].item() == 2.0
if RANK == 1:
    os._exit(3)
time.sleep(1.0)
start = time.monotonic()
try:
    dist.all_reduce(x)
    result = {"completed": True, "value": x[0].item()}
except Exception as e:  # noqa: BLE001 - what the user would see
    result = {"completed": False, "error": f"{type(e).__name__}: {e}"}
result["seconds"] = time.monotonic() - start
(OUT / "rank0.json").write_text(json.dumps(result))
print(json.dumps(result), flush=True)
sys.exit(0 if result["completed"] else 7)
