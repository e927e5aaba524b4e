"""Per-op eager latency: the bridge's `tpu` device vs torch CPU vs plain jax.numpy, in one run.

    python bench/bench_eager_ops.py [--iters N] [--write docs/benchmarks/eager_ops.md]

Each op runs on already-resident inputs; device results are synchronised (block_until_ready / .cpu()
is not in the loop: we wait on the last result once per measurement, as a user's program would).
Reported: median microseconds per op over repeated measurements, and the ratios the issue asks for.
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402

import torchbridge  # noqa: E402

DEV = torchbridge.device_name()


def _interleaved(arms: list, iters: int, repeats: int) -> list[float]:
    """Median microseconds per call for each (fn, sync) arm. The arms take turns within every
    repeat, so a slow spell on the shared machine hits all of them rather than one."""
    for fn, sync in arms:
        for _ in range(max(3, iters // 10)):
            fn()
        sync(fn())
    samples: list[list[float]] = [[] for _ in arms]
    for _ in range(repeats):
        for i, (fn, sync) in enumerate(arms):
            start = time.perf_counter()
            for _ in range(iters):
                r = fn()
            sync(r)
            samples[i].append((time.perf_counter() - start) / iters * 1e6)
    return [statistics.median(s) for s in samples]


def _sync_dev(t: torch.Tensor) -> None:
    getattr(torch, DEV).synchronize()


def cases():
    g = torch.Generator().manual_seed(0)
    a16, b16 = torch.randn(16, 16, generator=g), torch.randn(16, 16, generator=g)
    a64, b64 = torch.randn(64, 64, generator=g), torch.randn(64, 64, generator=g)
    a1k, b1k = torch.randn(1024, 1024, generator=g), torch.randn(1024, 1024, generator=g)
    s = torch.randn(64, 512, generator=g)
    return [
        ("add 16x16", (a16, b16), lambda x, y: x + y, lambda x, y: x + y),
        ("matmul 64x64", (a64, b64), lambda x, y: x @ y, lambda x, y: x @ y),
        ("softmax 64x512", (s,), lambda x: torch.softmax(x, -1), lambda x: jax.nn.softmax(x, -1)),
        ("matmul 1024x1024", (a1k, b1k), lambda x, y: x @ y, lambda x, y: x @ y),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=11, help="interleaved measurements per arm (median)")
    ap.add_argument("--write", default=None)
    args = ap.parse_args(argv)
    rows = []
    for name, inputs, torch_fn, jax_fn in cases():
        iters = args.iters if "1024" not in name else max(5, args.iters // 20)
        jx = [jnp.asarray(t.numpy()) for t in inputs]
        dv = [t.to(DEV) for t in inputs]
        cpu_us, jax_us, dev_us = _interleaved([
            (functools.partial(torch_fn, *inputs), lambda r: None),
            (functools.partial(jax_fn, *jx), lambda r: r.block_until_ready()),
            (functools.partial(torch_fn, *dv), _sync_dev),
        ], iters, args.repeats)
        rows.append((name, cpu_us, jax_us, dev_us))
    header = "| op | torch CPU (us) | jax.numpy (us) | torchbridge eager (us) | bridge - jax.numpy (us) | bridge / jax.numpy |"
    lines = [header, "|---|---:|---:|---:|---:|---:|"]
    for name, c, j, d in rows:
        lines.append(f"| {name} | {c:.1f} | {j:.1f} | {d:.1f} | {d - j:+.1f} | {d / j:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if args.write:
        env = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, jax {jax.__version__}"
        text = (f"# Eager per-op latency\n\nCommand: `python bench/bench_eager_ops.py --iters {args.iters} --repeats {args.repeats} --write {args.write}`\n\n"
                f"Machine: {env}. Medians of {args.repeats} measurements per arm, the three arms interleaved within each"
                f" repeat; device results synchronised.\n\n{table}\n\n"
                "Targets (issue 2): small ops at most 10 us above jax.numpy; large ops within 10% of jax.numpy.\n")
        Path(args.write).parent.mkdir(parents=True, exist_ok=True)
        Path(args.write).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
