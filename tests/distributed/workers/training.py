"""Five AdamW steps of TinyLlama under one parallelism, on the device or on the CPU with gloo (the
reference). argv: OUT MODE DEVICES [compile [CHECKPOINT_DIR save|resume]]. MODE: ddp | fsdp | fsdp_mp | tp |
fsdp_tp. DEVICES: "cpu", "tpu", or "cpu,tpu" (the CPU run, then the device's, in one job: one start-up
instead of two). With a checkpoint directory, "save" writes a torch.distributed.checkpoint of the device
run's model and optimizer after step 3; "resume" loads it and runs steps 4 and 5 only.
Writes OUT/<device>/rank{r}.pt: {"losses": [...], "params": {name: full tensor on the CPU}, "info": {...}}."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tiny_llama import VOCAB, TinyLlama, apply_tp

OUT, MODE, DEVICES = Path(sys.argv[1]), sys.argv[2], sys.argv[3].split(",")
COMPILE = len(sys.argv) > 4 and sys.argv[4] == "1"
CKPT = sys.argv[5] if len(sys.argv) > 6 else None
CKPT_MODE = sys.argv[6] if len(sys.argv) > 6 else None
SAVE_AFTER = 3
# CPU alone: a plain gloo job. With the device: its backend is the default group's, and CPU tensors on
# that group go to gloo (the group's CPU backend), so the CPU reference can run in the same job.
dist.init_process_group("gloo" if DEVICES == ["cpu"] else None)
RANK, WORLD = dist.get_rank(), dist.get_world_size()


def train(device: str) -> dict:
    dev = torch.device("cpu") if device == "cpu" else torch.device(device, int(os.environ["LOCAL_RANK"]))
    if device != "cpu":
        torch.get_device_module(device).set_device(dev)

    torch.manual_seed(0)  # the CPU generator: identical initial weights in both runs
    model = TinyLlama().to(dev)
    dp_rank = RANK
    if MODE == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=None if device == "cpu" else [dev])
    elif MODE in ("fsdp", "fsdp_mp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(dev.type, (WORLD,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if MODE == "fsdp_mp" else \
            MixedPrecisionPolicy()
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp, reshard_after_forward=True)
        fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=False)
    elif MODE == "tp":
        from torch.distributed.device_mesh import init_device_mesh

        apply_tp(model, init_device_mesh(dev.type, (WORLD,)))
        dp_rank = 0
    elif MODE == "fsdp_tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(dev.type, (WORLD // 2, 2), mesh_dim_names=("dp", "tp"))
        apply_tp(model, mesh["tp"])
        for block in model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        dp_rank = mesh["dp"].get_local_rank()
    else:
        raise SystemExit(f"unknown mode {MODE}")

    step_model = model
    if COMPILE:
        backend = "tpu" if device != "cpu" else "inductor"
        if MODE.startswith("fsdp"):  # as TorchTitan does: each block compiled, FSDP2's hooks between them
            for block in model.layers:
                block.compile(backend=backend)
        else:
            step_model = torch.compile(model, backend=backend)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)

    def checkpoint_state() -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd}

    first = 0
    if CKPT_MODE == "resume":
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = checkpoint_state()
        dcp.load(state, checkpoint_id=CKPT)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        first = SAVE_AFTER
    losses = []
    for step in range(first, 5):
        g = torch.Generator().manual_seed(100 * step + dp_rank)  # each data-parallel rank its own batch
        tokens = torch.randint(0, VOCAB, (2, 17), generator=g)  # 16 inputs: shards evenly over 2 and 4
        inputs, labels = tokens[:, :-1].to(dev), tokens[:, 1:].to(dev)
        loss = F.cross_entropy(step_model(inputs).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if CKPT_MODE == "save" and device != "cpu" and step + 1 == SAVE_AFTER:
            import torch.distributed.checkpoint as dcp

            dcp.save(checkpoint_state(), checkpoint_id=CKPT)

    params = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        params[name.removeprefix("module.")] = full.detach().cpu().float()
    info = {}
    if COMPILE:
        from torch._dynamo.utils import counters

        info["graph_breaks"] = sum(counters["graph_break"].values())
        if device != "cpu":
            import torchbridge.compile

            info["compile"] = torchbridge.compile.metrics()
    return {"losses": losses, "params": params, "info": info}


for device in DEVICES:
    (OUT / device).mkdir(parents=True, exist_ok=True)
    torch.save(train(device), OUT / device / f"rank{RANK}.pt")
dist.destroy_process_group()
