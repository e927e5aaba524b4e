"""One rank of a training job: `python -m torchbridge.train.trainer OUT/config.json` (cli.py starts it).

The loop: the step's global batch (data.py) -> this data-parallel rank's micro-batches -> forward,
cross-entropy, backward (accumulated) -> gradient clipping -> AdamW -> warm-up/cosine LR. Every rank
computes the loss of the whole global batch (averaged over the data-parallel group), so the logged
curve is the same whatever the rank count. A single-rank job has a process group too (one rank, an
in-memory store), so the code below has one path.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from torchbridge.train import checkpoint, data, metrics
from torchbridge.train import model as model_lib
from torchbridge.train.config import TrainConfig, from_dict
from torchbridge.train.export import export
from torchbridge.train.parallelize import parallelize


def lr_lambda(steps: int, warmup_fraction: float, min_ratio: float) -> Any:
    """The LR multiplier of step k: linear warm-up, then cosine decay to `min_ratio`."""
    warmup = max(1, round(warmup_fraction * steps))

    def factor(k: int) -> float:
        if k < warmup:
            return (k + 1) / warmup
        p = min(1.0, (k - warmup) / max(1, steps - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))

    return factor


def init_distributed(device_type: str) -> torch.device:
    """The job's process group (torchrun's env, or one rank with an in-memory store) and this rank's device."""
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    # on the device: its c10d backend for device tensors and gloo for CPU ones (the default map)
    backend = "gloo" if device_type == "cpu" else None
    if launched:
        dist.init_process_group(backend)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    if device_type == "cpu":
        return torch.device("cpu")
    device = torch.device(device_type, int(os.environ.get("LOCAL_RANK", "0")))
    torch.get_device_module(device_type).set_device(device)
    return device


def optimizer_for(model: torch.nn.Module, tr: Any) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not norms)."""
    params = list(dict.fromkeys(model.parameters()))  # tied weights once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": tr.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=tr.lr, betas=tuple(tr.betas), eps=tr.eps)


def autocast(device: torch.device, bf16: bool, fsdp: bool) -> contextlib.AbstractContextManager:
    """bf16 autocast on one data-parallel rank (with FSDP2 its mixed-precision policy casts instead)."""
    if not bf16 or fsdp:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16)


def loss_of(step_model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = step_model(input_ids=tokens[:, :-1]).logits
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())


@torch.no_grad()
def heldout_loss(step_model: torch.nn.Module, windows: torch.Tensor, device: torch.device, batch: int,
                 amp: Any) -> float:
    """Mean next-token loss over the held-out windows (every rank evaluates all of them: FSDP2 and TP need
    every rank in each forward). Whole batches of the training micro-batch size only, so compiled
    graphs see one shape."""
    n = windows.shape[0] - windows.shape[0] % batch if windows.shape[0] >= batch else windows.shape[0]
    rows = min(batch, n)
    total = torch.zeros((), device=device)
    for start in range(0, n, rows):
        with amp():
            total += loss_of(step_model, windows[start: start + rows].to(device)).float() * rows
    return float(total.item()) / n


def clip_or_norm(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the gradients' global 2-norm to `max_norm` (0: only measure it). With tensor parallelism some
    gradients are DTensors on the 2-d or the tp mesh and some (the norms' weights) are plain, and one
    foreach norm cannot mix them: each group's norm is taken on its own and made whole, then combined."""
    groups: dict[Any, list[torch.Tensor]] = {}
    for p in dict.fromkeys(p for p in model.parameters() if p.grad is not None):
        groups.setdefault(getattr(p.grad, "device_mesh", None), []).append(p.grad)
    norms = []
    for grads in groups.values():
        norm = torch.nn.utils.get_total_norm(grads, foreach=True)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    total = float(torch.linalg.vector_norm(torch.stack(norms)).item())
    coef = max_norm / (total + 1e-6)  # torch.nn.utils.clip_grads_with_norm_'s factor, as a Python number
    if max_norm > 0 and coef < 1:
        for grads in groups.values():
            torch._foreach_mul_(grads, coef)
    return total


def run(cfg: TrainConfig) -> dict[str, Any]:
    out = Path(cfg.job.out)
    tr = cfg.training
    device = init_distributed(cfg.job.device)
    rank = dist.get_rank()
    if cfg.job.threads:
        torch.set_num_threads(cfg.job.threads)
    prepared = data.load(out)
    tokenizer = prepared.tokenizer()
    hf_config = model_lib.hf_config(cfg.model, len(tokenizer), tokenizer)
    model = model_lib.build(hf_config, tr.seed).to(device)
    n_params = model_lib.num_params(model)
    step_model, mesh = parallelize(model, cfg, device.type)
    dp_mesh = mesh["dp_shard"]
    dp, dp_rank = dp_mesh.size(), dp_mesh.get_local_rank()
    optimizer = optimizer_for(model, tr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(tr.steps, tr.warmup_fraction,
                                                                      tr.min_lr_ratio))
    first = 0
    resumed_from = checkpoint.latest(out) if cfg.checkpoint.resume else None
    if resumed_from is not None:
        first = checkpoint.load(resumed_from, model, optimizer, scheduler)
    bf16 = tr.mixed_precision == "bfloat16"

    def amp() -> contextlib.AbstractContextManager:
        return autocast(device, bf16, fsdp=dp > 1)

    seq_len, accum = cfg.data.seq_len, tr.grad_accum
    tokens_per_step = tr.batch_size * seq_len
    flops_per_step = model_lib.flops_per_token(hf_config, n_params, seq_len) * tokens_per_step
    peak = cfg.metrics.peak_tflops * 1e12 if cfg.metrics.peak_tflops else \
        (metrics.measure_peak_flops(torch.bfloat16 if bf16 else torch.float32, device.type) if rank == 0 else 1.0)
    eval_windows = data.eval_windows(prepared.heldout, seq_len, cfg.eval.windows)
    micro_rows = tr.batch_size // (dp * accum)
    reporter = metrics.Reporter(out, tr.steps, first, cfg.metrics.log_every, cfg.metrics.progress_bar,
                                cfg.metrics.tensorboard, enabled=rank == 0)
    reporter.log(f"model: {n_params:,} parameters; {dist.get_world_size()} ranks (dp_shard {dp} x tp "
                 f"{cfg.parallel.tp}) on {device.type}; {tokens_per_step:,} tokens per step; peak "
                 f"{peak / 1e12:.3f} TFLOP/s" + (f"; resumed from {resumed_from}" if resumed_from else ""))
    losses: dict[int, float] = {}
    evals: dict[int, float] = {}
    train_seconds = 0.0
    for step in range(first + 1, tr.steps + 1):
        t0 = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        batch = data.global_batch(prepared.train, seq_len, tr.batch_size, tr.seed, step)
        loss_sum = torch.zeros((), device=device)
        for micro in data.local_micro_batches(batch, accum, dp, dp_rank):
            with amp():
                loss = loss_of(step_model, micro.to(device))
            (loss / accum).backward()
            loss_sum += loss.detach()
        grad_norm = clip_or_norm(model, tr.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss_sum / accum
        if dp > 1:
            dist.all_reduce(mean, op=dist.ReduceOp.AVG, group=dp_mesh.get_group())
        losses[step] = float(mean.item())
        seconds = time.perf_counter() - t0
        train_seconds += seconds
        reporter.step(step, {"loss": losses[step], "lr": lr, "grad_norm": grad_norm,
                             "tokens_per_s": tokens_per_step / seconds, "mfu": flops_per_step / seconds / peak,
                             "memory_gib": metrics.memory_bytes(device) / 2 ** 30, "step_seconds": seconds})
        if not math.isfinite(losses[step]):
            raise FloatingPointError(f"step {step}: loss is {losses[step]}")
        if cfg.eval.every and step % cfg.eval.every == 0 and step != tr.steps:
            evals[step] = heldout_loss(step_model, eval_windows, device, micro_rows, amp)
            reporter.record(step, {"heldout_loss": evals[step]})
            reporter.log(f"step {step:5d}  held-out loss {evals[step]:.4f}")
        if cfg.checkpoint.every and step % cfg.checkpoint.every == 0 and step != tr.steps:
            checkpoint.save(out, step, model, optimizer, scheduler)
    summary: dict[str, Any] = {"first_step": first, "steps": tr.steps, "losses": losses, "params": n_params,
                               "ranks": dist.get_world_size(), "device": device.type, "train_seconds": train_seconds,
                               "tokens_per_step": tokens_per_step, "flops_per_step": flops_per_step,
                               "peak_flops": peak}
    if first < tr.steps:
        evals[tr.steps] = heldout_loss(step_model, eval_windows, device, micro_rows, amp)
        reporter.record(tr.steps, {"heldout_loss": evals[tr.steps]})
        reporter.log(f"step {tr.steps:5d}  held-out loss {evals[tr.steps]:.4f}")
        checkpoint.save(out, tr.steps, model, optimizer, scheduler)
    summary["heldout_losses"] = evals
    if cfg.export.enabled:
        path = export(model, hf_config, tokenizer, out, cfg.export.dtype)
        if path is not None:
            reporter.log(f"exported a Hugging Face checkpoint to {path}")
    reporter.close()
    if rank == 0:
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    dist.destroy_process_group()
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg = from_dict(json.loads(Path(argv[0]).read_text()))
    run(cfg)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
