"""torch.distributed on the device against gloo on CPU tensors, in the same jobs.

    python bench/bench_distributed.py [--ranks 2 4] [--rounds 5] [--write docs/benchmarks/distributed.md]
    python bench/bench_distributed.py --fsdp [--rounds 5] [--write ...]   # FSDP2 training step, 2 ranks

Collectives: every rank runs all_reduce, all_gather_into_tensor and reduce_scatter_tensor from 1 KiB to
64 MiB (float32) through the device's backend on device tensors (XLA collectives, the default; and a
second device group with TORCHBRIDGE_COLLECTIVES=host: host copies through PyTorch's gloo), each
synchronised after the call, and through a gloo group on CPU tensors, the three arms taking turns inside
every round. Reported per size: median time of each arm over the rounds (each round's figure a median of
several calls), and device/gloo with its range over the rounds (the target: at most 1.5x at 4 MiB and up).

FSDP2 step (--fsdp): a ~20M-parameter Llama (TorchTitan-style, TP-ready) sharded with FSDP2 over 2
ranks, AdamW, each block compiled (as TorchTitan does): torch.compile(backend="tpu") on the device vs
torch.compile (inductor) on CPU tensors with gloo, both in the same processes, arms alternated per
round. Reported: step time medians and bridge speed-up (inductor time / bridge time) with its range.

The script launches torchrun itself (127.0.0.1); one OpenMP/XLA thread per rank (two ranks fill the
two cores of the machine this was written on). The FSDP2 job gives each process one emulated chip (its
`tpu:0`, as on a TPU host with a process per chip; BENCH_CHIPS=N for N): XLA:CPU sizes its thread pools
by max(cores, emulated chips), so N chips on a rank's one pinned core would run N compute threads there.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SIZES = [1 << 10, 1 << 14, 1 << 18, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
OPS = ("all_reduce", "all_gather", "reduce_scatter")


def _fmt_size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


# ---- worker side ---------------------------------------------------------------------------------
def _median_time(fn, sync, calls: int) -> float:
    """Median of `calls` timed calls after one untimed one. Every rank makes the same number of calls:
    a collective per call, so a count decided by each rank's own clock would leave one waiting."""
    fn()
    sync()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def worker_collectives(out: Path, rounds: int) -> None:
    _pin_to_core()
    import torch
    import torch.distributed as dist

    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("tpu", int(os.environ["LOCAL_RANK"]))
    torch.tpu.set_device(dev)
    gloo = dist.new_group(backend="gloo")
    os.environ["TORCHBRIDGE_COLLECTIVES"] = "host"  # a second device group with the host-copy transport
    host = dist.new_group()
    os.environ.pop("TORCHBRIDGE_COLLECTIVES")
    results: dict[str, dict[str, list[float]]] = {}
    for _ in range(rounds):
        for size in SIZES:
            n = size // 4
            for op in OPS:
                arms = {}
                for arm in ("device", "host", "gloo", "jax"):
                    d = torch.device("cpu") if arm == "gloo" else dev
                    group = {"device": None, "host": host, "gloo": gloo, "jax": None}[arm]
                    x = torch.ones(n, device=d)
                    if arm == "jax":  # the same XLA program on a ready buffer: no tensors, no c10d (the floor)
                        from torchbridge.device import buffers
                        from torchbridge.distributed import collectives

                        mesh = dist.distributed_c10d._get_default_group()._mesh([x])
                        v = buffers.flat_value(x)
                        run = {"all_reduce": lambda v=v, mesh=mesh: collectives.all_reduce(mesh, v, "sum"),
                               "all_gather": lambda v=v, mesh=mesh: collectives.all_gather(mesh, v),
                               "reduce_scatter": lambda v=v, mesh=mesh: collectives.reduce_scatter(mesh, v, "sum")}[op]
                        last: list = []

                        def fn(run=run, last=last):
                            last[:] = [run()]

                        arms[arm] = _median_time(fn, lambda last=last: last[0].block_until_ready(),
                                                 max(3, min(30, (8 << 20) // size)))
                        continue
                    if op == "all_reduce":
                        def fn(x=x, group=group):
                            dist.all_reduce(x, group=group)
                    elif op == "all_gather":
                        o = torch.empty(n * world, device=d)

                        def fn(x=x, o=o, group=group):
                            dist.all_gather_into_tensor(o, x, group=group)
                    else:
                        o = torch.empty(n // world, device=d)

                        def fn(x=x, o=o, group=group):
                            dist.reduce_scatter_tensor(o, x, group=group)
                    sync = (lambda: None) if arm == "gloo" else torch.tpu.synchronize
                    dist.barrier(group=gloo)
                    arms[arm] = _median_time(fn, sync, max(3, min(30, (8 << 20) // size)))
                for arm, t in arms.items():
                    results.setdefault(f"{op}/{size}", {}).setdefault(arm, []).append(t)
    if rank == 0:
        (out / "collectives.json").write_text(json.dumps({"world": world, "results": results}))
    dist.destroy_process_group()


def _pin_to_core() -> None:
    """One core per rank (as one chip per process): XLA sizes its thread pool from this process's CPU
    affinity, so two ranks on two cores do not run four compute threads. Both arms share the pinning."""
    cores = sorted(os.sched_getaffinity(0))
    if int(os.environ["LOCAL_WORLD_SIZE"]) <= len(cores) and os.environ.get("BENCH_PIN", "1") == "1":
        os.sched_setaffinity(0, {cores[int(os.environ["LOCAL_RANK"]) % len(cores)]})


def worker_fsdp(out: Path, rounds: int, steps: int) -> None:
    _pin_to_core()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "distributed" / "workers"))
    import tiny_llama

    # ~20M parameters: the shape bench_compile.py's model has, with a TorchTitan-style block
    tiny_llama.use_bench_shape()
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("tpu", int(os.environ["LOCAL_RANK"]) % torch.tpu.device_count())
    torch.tpu.set_device(dev)
    setups = {}
    for arm, d, backend in (("bridge", dev, "tpu"), ("inductor", torch.device("cpu"), "inductor")):
        torch.manual_seed(0)
        model = tiny_llama.TinyLlama().to(d)
        if not os.environ.get("BENCH_NO_FSDP"):  # (unsharded: the compute alone, for comparison)
            mesh = init_device_mesh(d.type, (world,))
            for block in model.layers:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        for block in model.layers:
            block.compile(backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        g = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, tiny_llama.VOCAB, (4, 129), generator=g)
        setups[arm] = (model, opt, tokens[:, :-1].to(d), tokens[:, 1:].to(d), d)
    params = sum(p.numel() for p in setups["bridge"][0].parameters())  # a DTensor counts its whole tensor

    def step(arm: str) -> float:
        model, opt, x, y, d = setups[arm]
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()  # reads the value: the step is done on both devices

    times: dict[str, list[float]] = {"bridge": [], "inductor": []}
    losses = {}
    for arm in times:  # warm-up: compiles and the first steps
        for _ in range(3):
            losses[arm] = step(arm)
    if os.environ.get("BENCH_PROFILE"):  # where a step's time goes, per arm (rank 0 prints)
        import cProfile
        import pstats

        import torchbridge

        before = torchbridge.metrics()
        step("bridge")
        after = torchbridge.metrics()
        if rank == 0:  # a warm step should compile nothing and fall back to the CPU for nothing
            print("==== one warm bridge step: compiles", after["compiles"] - before["compiles"],
                  "cpu fallbacks", {k: v - before["cpu_fallbacks"].get(k, 0) for k, v in after["cpu_fallbacks"].items()
                                    if v != before["cpu_fallbacks"].get(k, 0)},
                  "fast-path hits", after["fast_path_hits"] - before["fast_path_hits"],
                  "donated writes", after["donated_writes"] - before["donated_writes"])
        for arm in times:
            prof = cProfile.Profile()
            prof.enable()
            step(arm)
            prof.disable()
            if rank == 0:
                print(f"==== {arm}")
                pstats.Stats(prof).sort_stats("cumulative").print_stats(int(os.environ.get("BENCH_PROFILE", "35")))
    if os.environ.get("BENCH_PHASES"):  # per-phase time, each phase synchronised (rank 0 prints medians)
        _phases(setups, rank, int(os.environ["BENCH_PHASES"]))
    if os.environ.get("BENCH_TRACE"):  # a jax.profiler trace of two free-running bridge steps per rank
        import jax

        opts = jax.profiler.ProfileOptions()
        opts.python_tracer_level = 0
        jax.profiler.start_trace(f"{os.environ['BENCH_TRACE']}/rank{rank}", profiler_options=opts)
        for _ in range(2):
            step("bridge")
        jax.profiler.stop_trace()
    busy: dict[str, list[float]] = {"bridge": [], "inductor": []}  # CPU seconds per wall second, this rank
    for _ in range(rounds):
        for arm in times:
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(steps):
                step(arm)
            times[arm].append((time.perf_counter() - t0) / steps)
            busy[arm].append((time.process_time() - c0) / (time.perf_counter() - t0))
    print(f"rank {rank}: CPU busy per wall second, median: "
          + ", ".join(f"{arm} {statistics.median(v):.2f}" for arm, v in busy.items()), flush=True)
    if rank == 0:
        (out / "fsdp.json").write_text(json.dumps({"world": world, "params": params, "times": times,
                                                   "losses": losses}))
    dist.destroy_process_group()


def _phases(setups: dict, rank: int, rounds: int) -> None:
    """Forward, loss, backward and optimizer step timed apart, waiting for the device after each (which
    removes the overlap a normal step has: the sum is an upper bound of a step)."""
    import itertools
    import statistics

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    def sync(d) -> None:
        if d.type != "cpu":
            torch.tpu.synchronize(d)
        dist.barrier()

    spent: dict[str, dict[str, list[float]]] = {arm: {} for arm in setups}
    for _ in range(rounds):
        for arm, (model, opt, x, y, d) in setups.items():
            sync(d)
            marks = [("start", time.perf_counter())]
            logits = model(x)
            sync(d)
            marks.append(("forward", time.perf_counter()))
            loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
            sync(d)
            marks.append(("loss", time.perf_counter()))
            loss.backward()
            sync(d)
            marks.append(("backward", time.perf_counter()))
            opt.step()
            opt.zero_grad()
            sync(d)
            marks.append(("optimizer", time.perf_counter()))
            for (_, t0), (name, t1) in itertools.pairwise(marks):
                spent[arm].setdefault(name, []).append((t1 - t0) * 1e3)
    if rank == 0:
        for arm, phases in spent.items():
            print(f"==== phases {arm}: " + ", ".join(f"{k} {statistics.median(v):.1f} ms" for k, v in phases.items()))


# ---- driver --------------------------------------------------------------------------------------
def _launch(nproc: int, args: list[str], port: int, chips: int | None = None) -> None:
    """torchrun with `nproc` ranks on this host; each process emulates `chips` CPU devices (default nproc)."""
    extra = os.environ.get("BENCH_XLA_FLAGS", "")  # e.g. threading flags to compare
    chips = nproc if chips is None else chips
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={chips} {extra}".strip(),
           "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
           f"--master-port={port}", __file__, *args]
    subprocess.run(cmd, env=env, check=True, timeout=3600)


def _ratio_row(dev: list[float], ref: list[float]) -> tuple[float, float, float]:
    ratios = sorted(a / b for a, b in zip(dev, ref, strict=True))
    return statistics.median(ratios), ratios[0], ratios[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fsdp", action="store_true", help="the FSDP2 training step instead of the collectives")
    ap.add_argument("--steps", type=int, default=3, help="FSDP2 steps per round and arm")
    ap.add_argument("--nproc", type=int, default=2, help="FSDP2 ranks")
    ap.add_argument("--write", default=None)
    ap.add_argument("--worker", choices=["collectives", "fsdp"], help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "collectives":
        worker_collectives(Path(args.out), args.rounds)
        return 0
    if args.worker == "fsdp":
        worker_fsdp(Path(args.out), args.rounds, args.steps)
        return 0

    import tempfile

    load = os.getloadavg()
    lines = []
    cmd = "python bench/bench_distributed.py " + " ".join(a for a in (argv or sys.argv[1:]))
    with tempfile.TemporaryDirectory() as tmp:
        if args.fsdp:
            _launch(args.nproc, ["--worker", "fsdp", "--out", tmp, "--rounds", str(args.rounds), "--steps",
                                 str(args.steps)], 29960, chips=int(os.environ.get("BENCH_CHIPS", "1")))
            data = json.loads((Path(tmp) / "fsdp.json").read_text())
            t = data["times"]
            speed = sorted(a / b for a, b in zip(t["inductor"], t["bridge"], strict=True))
            lines += [f"FSDP2 training step, {data['params'] / 1e6:.1f}M-parameter Llama, {args.nproc} ranks, batch 4 x 128 per rank, "
                      f"{args.rounds} rounds x {args.steps} steps, arms alternated:", "",
                      "| arm | step (median ms) | range (ms) | last warm-up loss |", "|---|---|---|---|"]
            names = {"bridge": 'torch.compile(backend="tpu"), device', "inductor": "torch.compile (inductor), CPU + gloo"}
            for arm in ("bridge", "inductor"):
                lines.append(f"| {names[arm]} "
                             f"| {statistics.median(t[arm]) * 1e3:.1f} | {min(t[arm]) * 1e3:.1f}-{max(t[arm]) * 1e3:.1f} "
                             f"| {data['losses'][arm]:.4f} |")
            lines += ["", f"Bridge speed-up (inductor time / bridge time): median {statistics.median(speed):.2f}x, "
                      f"range {speed[0]:.2f}-{speed[-1]:.2f}x."]
        else:
            for nproc in args.ranks:
                _launch(nproc, ["--worker", "collectives", "--out", tmp, "--rounds", str(args.rounds)], 29950 + nproc)
                data = json.loads((Path(tmp) / "collectives.json").read_text())["results"]
                lines += [f"### {nproc} ranks", "",
                          "| collective | size | device, XLA (ms) | device, host copies (ms) | gloo on CPU (ms) | "
                          "XLA / gloo (median, range) | host / gloo (median, range) | JAX's program alone / gloo |",
                          "|---|---|---|---|---|---|---|---|"]
                for op in OPS:
                    for size in SIZES:
                        r = data[f"{op}/{size}"]
                        xla, host = _ratio_row(r["device"], r["gloo"]), _ratio_row(r["host"], r["gloo"])
                        floor = _ratio_row(r["jax"], r["gloo"])
                        lines.append(f"| {op} | {_fmt_size(size)} | {statistics.median(r['device']) * 1e3:.3f} | "
                                     f"{statistics.median(r['host']) * 1e3:.3f} | {statistics.median(r['gloo']) * 1e3:.3f} "
                                     f"| {xla[0]:.2f}x ({xla[1]:.2f}-{xla[2]:.2f}) | {host[0]:.2f}x ({host[1]:.2f}-{host[2]:.2f}) "
                                     f"| {floor[0]:.2f}x |")
                lines.append("")
    header = [f"Command: `{cmd.strip()}`", "",
              f"Machine: {os.cpu_count()} cores, load average at start {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}; "
              f"{time.strftime('%Y-%m-%d')}.", ""]
    text = "\n".join(header + lines) + "\n"
    print(text)
    if args.write:
        path = Path(args.write)
        title = "## FSDP2 training step" if args.fsdp else "## Collectives"
        old = path.read_text() if path.exists() else "# torch.distributed on the device\n"
        sections = old.split("\n## ")
        kept = [sections[0]] + ["## " + s for s in sections[1:] if not ("## " + s).startswith(title)]
        path.write_text("\n".join(k.rstrip("\n") + "\n" for k in kept) + f"\n{title}\n\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
