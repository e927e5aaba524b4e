"""A ~20M-parameter Llama on this CPU: torch eager, inductor, bridge eager, bridge fused eager, bridge compiled.

    python bench/bench_compile.py [--quick] [--write docs/benchmarks/compile.md]
    python bench/bench_compile.py --sweep [--quick] [--neighbour] [--write docs/benchmarks/compile.md]
    python bench/bench_compile.py --dlrm [--quick] [--neighbour] [--steps 200] [--write docs/benchmarks/compile.md]

Measures forward latency at batch 1 and 8 (sequence 128) and one training step (forward, backward,
AdamW) for each arm, in one run, the arms taking turns within each iteration, and reports ratios.
The `compiled-xla-only` arm is `compiled` with TORCHBRIDGE_HOST_KERNELS=0 (XLA's own dot and
attention written in JAX instead of PyTorch's CPU GEMM and flash attention as custom calls); `compiled`
itself uses PyTorch's GEMM only where it measured faster on this machine (host_calls.gemm_probe), and
`compiled-host-gemm` forces it (TORCHBRIDGE_HOST_GEMM=1). A second part measures cold start: the time to
the first compiled forward in a fresh process, twice, with the persistent XLA cache (the second
process finds the first one's executables on disk).

`--sweep` runs the shape sweep instead: batch {1, 2, 4, 8, 16} x sequence {64, 128, 256, 512} x hidden
{256, 512, 768, 1024} (Llamas with grouped-query attention, bench/compile_workloads.py), forward and
training step, bridge compiled vs Inductor, arms alternated, logits and gradients compared per cell;
a table and a heat map (PNG) go into a section of --write's file, the geometric means and worst
cells are printed last (`--quick`: two small cells, a sanity run). `--dlrm` measures jagged DLRM
training (index lists of a new length every step) in steps/s against Inductor with default
settings, and how many programs each compiled. `--neighbour` runs either with a busy-loop process
pinned to one core during both arms. Both record the load average.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import transformers

import compile_workloads  # bench/ is the script's directory, so on sys.path
import torchbridge
from torchbridge.device import eager_mode, host_calls

DEV = torchbridge.device_name()


def make_model(quick: bool) -> torch.nn.Module:
    cfg = transformers.LlamaConfig(
        vocab_size=8192, hidden_size=384 if not quick else 128, intermediate_size=1024 if not quick else 256,
        num_hidden_layers=6 if not quick else 2, num_attention_heads=6 if not quick else 4, num_key_value_heads=2,
        max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


def _sync(device: str) -> None:
    if device != "cpu":
        getattr(torch, torch.device(device).type).synchronize()


class Arm:
    """One arm's model copy and its three workloads, each a callable that runs one iteration."""

    def __init__(self, key: str, name: str, model: torch.nn.Module, device: str, compile_backend: str | None,
                 mode: str, env: dict[str, str], seq: int) -> None:
        self.key, self.name, self.device, self.mode, self.env = key, name, device, mode, env
        m = copy.deepcopy(model).to(device)
        self.fwd_model = torch.compile(m, backend=compile_backend) if compile_backend else m
        self.inputs = {b: torch.randint(0, 8192, (b, seq)).to(device) for b in (1, 8)}
        self.opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        # compiled arms compile the optimizer step too (its own graph: backward is a graph break)
        self.opt_step = torch.compile(self.opt.step, backend=compile_backend) if compile_backend else self.opt.step
        self.work = {"fwd_b1_ms": lambda: self._fwd(1), "fwd_b8_ms": lambda: self._fwd(8),
                     "train_step_ms": self._train}

    def _fwd(self, batch: int) -> torch.Tensor:
        with torch.no_grad():
            return self.fwd_model(input_ids=self.inputs[batch]).logits

    def _train(self) -> None:
        self.opt.zero_grad()
        ids = self.inputs[8]
        self.fwd_model(input_ids=ids, labels=ids).loss.backward()
        self.opt_step()

    def run(self, metric: str) -> float:
        """Seconds for one iteration, including waiting for the device."""
        saved = {k: os.environ.get(k) for k in self.env}
        os.environ.update(self.env)
        eager_mode.set_mode(self.mode)
        try:
            t = time.perf_counter()
            self.work[metric]()
            _sync(self.device)
            return time.perf_counter() - t
        finally:
            eager_mode.set_mode("eager")
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def measure(arms: list[Arm], metrics: list[str], warmup: int, iters: int) -> dict[str, dict[str, float]]:
    """Median ms per arm and metric. The arms take turns within each iteration, so a slow minute on a
    shared machine lands on every arm alike instead of on whichever arm ran then."""
    results: dict[str, dict[str, float]] = {a.key: {} for a in arms}
    for metric in metrics:
        live = []
        for a in arms:
            try:
                for _ in range(warmup):
                    a.run(metric)
                live.append(a)
            except Exception as e:  # noqa: BLE001 - report the arm as failed, keep measuring the others
                print(f"{a.name} {metric}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        samples: dict[str, list[float]] = {a.key: [] for a in live}
        for _ in range(iters):
            for a in live:
                samples[a.key].append(a.run(metric))
        for a in live:
            results[a.key][metric] = statistics.median(samples[a.key]) * 1e3
        print(metric + "  " + "  ".join(f"{a.key}={results[a.key][metric]:.1f}" for a in live), flush=True)
    return results


_COLD = """
import time, torch, transformers, torchbridge
cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size={h}, intermediate_size={i}, num_hidden_layers={l},
    num_attention_heads={a}, num_key_value_heads=2, max_position_embeddings=512)
torch.manual_seed(0)
m = transformers.LlamaForCausalLM(cfg).eval().to("{dev}")
ids = torch.randint(0, 8192, (1, {seq})).to("{dev}")
c = torch.compile(m, backend="tpu")
t = time.perf_counter()
with torch.no_grad():
    c(input_ids=ids).logits.cpu()
print(time.perf_counter() - t)
"""


def cold_start(args) -> tuple[float, float]:
    size = dict(h=128, i=256, l=2, a=4) if args.quick else dict(h=384, i=1024, l=6, a=6)
    code = _COLD.format(dev=DEV, seq=args.seq, **size)
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHBRIDGE_COMPILE_CACHE_DIR=cache, TORCHBRIDGE_COMPILE_CACHE_MIN_SECS="0")
        times = []
        for _ in range(2):
            r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
            times.append(float(r.stdout.strip().splitlines()[-1]))
    return times[0], times[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="a tiny model, for a smoke run")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--arms", default="cpu,inductor,eager,fused,compiled,compiled-xla-only,compiled-host-gemm")
    ap.add_argument("--write", default=None)
    ap.add_argument("--torch-device", default="cpu", help="where the torch eager/inductor arms run (cpu, cuda)")
    ap.add_argument("--sweep", action="store_true", help="the shape sweep (batch x sequence x hidden) instead")
    ap.add_argument("--dlrm", action="store_true", help="jagged DLRM training, steps/s vs Inductor, instead")
    ap.add_argument("--steps", type=int, default=200, help="--dlrm: timed steps")
    ap.add_argument("--neighbour", action="store_true", help="--sweep/--dlrm: a busy-loop process on one core")
    ap.add_argument("--heatmap-from", default=None, metavar="MD",
                    help="redraw <MD stem>_sweep.png from every sweep cell in MD's tables, then exit")
    for axis in ("batch", "seq", "hidden"):
        ap.add_argument(f"--sweep-{axis}", default=None, help=f"--sweep: only these {axis} values (comma-separated)")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.heatmap_from:
        md = Path(args.heatmap_from)
        n = compile_workloads.heatmap_from_tables(md, md.with_name(md.stem + "_sweep.png"))
        print(f"{n} cells drawn")
        return 0
    if args.sweep:
        only = {axis: tuple(int(v) for v in getattr(args, f"sweep_{axis}").split(","))
                for axis in ("batch", "seq", "hidden") if getattr(args, f"sweep_{axis}")}
        # 3 warm-up calls: the second compiles the variants a warm program runs (donating the optimizer's
        # state, writing outputs into spare buffers), so 1 left those compiles inside the timed calls
        compile_workloads.run_sweep(args.quick, args.warmup if "--warmup" in argv else 3,
                                    args.iters if "--iters" in argv else (2 if args.quick else 5), args.neighbour,
                                    args.write, argv, only)
        return 0
    if args.dlrm:
        compile_workloads.run_dlrm(args.quick, args.steps, args.neighbour, args.write, argv)
        return 0
    model = make_model(args.quick)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"Llama with {n_params / 1e6:.1f}M parameters, sequence {args.seq}", flush=True)
    arms = {
        "cpu": (f"torch {args.torch_device} eager", args.torch_device, None, "eager", {}),
        "inductor": ("torch.compile inductor", args.torch_device, "inductor", "eager", {}),
        "eager": ("bridge eager", DEV, None, "eager", {}),
        "fused": ("bridge fused eager", DEV, None, "fused", {}),
        "compiled": ("bridge compiled", DEV, "tpu", "eager", {}),
        # the same, XLA only: no PyTorch kernels as custom calls (device/host_calls.py)
        "compiled-xla-only": ("bridge compiled, XLA only", DEV, "tpu", "eager", {"TORCHBRIDGE_HOST_KERNELS": "0"}),
        "compiled-host-gemm": ("bridge compiled, PyTorch's GEMM forced", DEV, "tpu", "eager",
                               {"TORCHBRIDGE_HOST_GEMM": "1"}),
    }
    keys = args.arms.split(",")
    built = [Arm(k, arms[k][0], model, *arms[k][1:], args.seq) for k in keys]
    metrics = ["fwd_b1_ms", "fwd_b8_ms", "train_step_ms"]
    results = {k: v for k, v in measure(built, metrics, args.warmup, args.iters).items() if v}
    cold = cold_start(args) if "compiled" in results else None
    lines = ["| arm | " + " | ".join(metrics) + " |", "|---|" + "---:|" * len(metrics)]
    for key, res in results.items():
        lines.append(f"| {arms[key][0]} | " + " | ".join(f"{res.get(m, float('nan')):.1f}" for m in metrics) + " |")
    ratios = []
    for a, b, label in (("compiled", "inductor", "bridge compiled vs inductor (speedup, >=1.0 is the target)"),
                        ("eager", "fused", "fused eager vs plain bridge eager (speedup, >=3.0 is the target)"),
                        ("fused", "compiled", "fused eager time / bridge compiled time (<=1.25 is the target)")):
        if a in results and b in results:
            num, den = (results[b], results[a]) if a == "compiled" else (results[a], results[b])
            ratios.append(f"| {label} | " + " | ".join(f"{num[m] / den[m]:.2f}x" for m in metrics) + " |")
    table = "\n".join(lines + ["", "| ratio | " + " | ".join(metrics) + " |", "|---|" + "---:|" * len(metrics)] + ratios)
    print(table)
    if cold:
        print(f"cold start, first compiled forward: first process {cold[0]:.1f} s, second process {cold[1]:.1f} s")
    if args.write:
        where = f"bridge on {getattr(torch, DEV).get_device_name()}, torch arms on {args.torch_device}"
        text = (f"# Compiled and fused modes on a {n_params / 1e6:.1f}M-parameter Llama ({where})\n\n"
                f"Command: `python bench/bench_compile.py {' '.join(argv or sys.argv[1:])}`\n\n"
                f"Milliseconds, median of {args.iters} after {args.warmup} warm-up runs, the arms taking turns"
                f" within each iteration; sequence {args.seq}.\n\n{table}\n")
        if host_calls.enabled():
            probe = host_calls.gemm_probe()
            text += (f"\nGEMM choice on this machine (host_calls.gemm_probe, {'x'.join(map(str, host_calls.GEMM_PROBE))}):"
                     f" PyTorch's GEMM {probe['torch_ms']:.2f} ms, XLA's dot {probe['xla_ms']:.2f} ms, so"
                     f" `bridge compiled` uses {'PyTorch' if probe['host_gemm'] else 'XLA'}'s.\n")
        if cold:
            text += (f"\nCold start (time to the first compiled forward in a fresh process, persistent XLA cache):"
                     f" first process {cold[0]:.1f} s, second process {cold[1]:.1f} s ({cold[0] / cold[1]:.1f}x).\n")
        old = Path(args.write).read_text() if Path(args.write).exists() else ""
        # the sweep's and the DLRM run's sections (written by --sweep / --dlrm) stay
        blocks = [m.group(0) for m in re.finditer(r"<!-- ([\w-]+) -->\n.*?<!-- /\1 -->\n", old, flags=re.S)]
        Path(args.write).write_text(text + "".join("\n" + b for b in blocks))
        Path(args.write).with_suffix(".json").write_text(json.dumps({"results": results, "cold_start": cold}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
