"""What a run reports: loss, tokens per second, MFU and memory, to the terminal (a tqdm progress bar and
a log line every `log_every` steps), to OUT/metrics.jsonl, and to TensorBoard (OUT/tensorboard) when the
tensorboard package is installed. Only rank 0 writes.

MFU = model FLOPs per second / peak FLOPs per second. Model FLOPs per token are counted from the
architecture (model.flops_per_token). The peak is the chip's (`metrics.peak_tflops`) or, by default,
measured at start: the best of a few large GEMMs in the training dtype, with PyTorch's CPU GEMM and, on
the bridge's device, XLA's. On the emulated chips every rank shares the one host, so the job's MFU is
the job's FLOPs over the host's peak.
"""

from __future__ import annotations

import json
import resource
import time
from pathlib import Path
from typing import Any

import torch


def _best_gemm_seconds(a: torch.Tensor, b: torch.Tensor, repeats: int, sync: Any) -> float:
    (a @ b).sum().item()  # warm-up (and compile, on the device)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        c = a @ b
        sync(c)
        best = min(best, time.perf_counter() - t0)
    return best


def measure_peak_flops(dtype: torch.dtype, device: str = "cpu", n: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of the fastest of `repeats` n x n x n products (PyTorch's CPU GEMM, and the device's if given)."""
    flops = 2.0 * n ** 3
    best = float("inf")
    for dev in dict.fromkeys(["cpu", device]):
        a = torch.randn(n, n, dtype=torch.float32).to(dtype).to(dev)
        b = torch.randn(n, n, dtype=torch.float32).to(dtype).to(dev)

        def sync(c: torch.Tensor, dev: str = dev) -> None:
            if dev != "cpu":
                c[0, 0].item()  # reading one value waits for the product

        best = min(best, _best_gemm_seconds(a, b, repeats, sync))
    return flops / best


def memory_bytes(device: torch.device) -> int:
    """Peak memory of this rank: the device's allocator peak, or the process's peak RSS on the CPU."""
    if device.type != "cpu":
        return int(torch.get_device_module(device.type).max_memory_allocated(device))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class Reporter:
    """Rank 0's outputs. `step` takes one step's numbers; `eval` a held-out loss; `close` flushes."""

    def __init__(self, out: Path, total_steps: int, first_step: int, log_every: int, progress_bar: bool,
                 tensorboard: bool, enabled: bool) -> None:
        self.enabled, self.log_every = enabled, log_every
        self.bar = self.tb = None
        self.file = None
        if not enabled:
            return
        self.file = (out / "metrics.jsonl").open("a")
        if progress_bar:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=first_step, unit="step", dynamic_ncols=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard is optional
                self.log("tensorboard is not installed: no OUT/tensorboard events")
            else:
                self.tb = SummaryWriter(str(out / "tensorboard"))

    def log(self, line: str) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def record(self, step: int, values: dict[str, float]) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps({"step": step, **values}) + "\n")
        self.file.flush()
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)

    def step(self, step: int, values: dict[str, float]) -> None:
        self.record(step, values)
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{values['loss']:.4f}", tok_s=f"{values['tokens_per_s']:.0f}",
                                 mfu=f"{100 * values['mfu']:.1f}%", refresh=False)
        if step % self.log_every == 0 or step == 1:
            self.log(f"step {step:5d}  loss {values['loss']:.4f}  lr {values['lr']:.2e}  "
                     f"grad_norm {values['grad_norm']:.3f}  {values['tokens_per_s']:.0f} tok/s  "
                     f"mfu {100 * values['mfu']:.1f}%  mem {values['memory_gib']:.2f} GiB")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.tb is not None:
            self.tb.close()
        if self.file is not None:
            self.file.close()
