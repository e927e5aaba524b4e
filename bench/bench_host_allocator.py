"""The host allocator policy (src/torchbridge/host_allocator.py) against glibc's defaults, per arm.

    python bench/bench_host_allocator.py [--rounds 3] [--arms cpu,inductor,eager,fused,compiled] [--write FILE]

The policy is process-wide and set while `import torch` runs, so each measurement is a fresh process:
for every round and arm, one process with the policy (`keep`) and one with TORCHBRIDGE_HOST_ALLOCATOR=default,
taking turns. Each process builds the compile bench's Llama (15.7M parameters), runs a forward at batch 8
x 128 under no_grad and a training step (forward, backward, AdamW), `--warmup` untimed then `--iters`
timed, and reports the median milliseconds and the page faults per iteration (the kernel's minor-fault
counter). Arms: PyTorch eager and Inductor on `cpu`; the bridge's eager, fused eager and compiled modes.
The table gives each arm's medians over the rounds and default / keep per round (median, range).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ARMS = ("cpu", "inductor", "eager", "fused", "compiled")
WORK = ("fwd_b8", "train_step")


def child(arm: str, warmup: int, iters: int) -> dict:
    import resource

    import torch

    import torchbridge
    from bench_compile import make_model  # bench/ is the script's directory, so on sys.path
    from torchbridge import host_allocator
    from torchbridge.device import eager_mode

    dev = "cpu" if arm in ("cpu", "inductor") else torchbridge.device_name()
    m = make_model(quick=False).train().to(dev)
    ids = torch.randint(0, 8192, (8, 128)).to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    backend = {"inductor": "inductor", "compiled": "tpu"}.get(arm)
    fm = torch.compile(m, backend=backend) if backend else m
    step = torch.compile(opt.step, backend=backend) if backend else opt.step
    if arm == "fused":
        eager_mode.set_mode("fused")

    def sync() -> None:
        if dev != "cpu":
            getattr(torch, dev).synchronize()

    def fwd() -> None:
        with torch.no_grad():
            fm(input_ids=ids)
        sync()

    def train() -> None:
        opt.zero_grad()
        fm(input_ids=ids, labels=ids).loss.backward()
        step()
        sync()

    out: dict = {"policy": host_allocator.state()}
    for name, fn in (("fwd_b8", fwd), ("train_step", train)):
        for _ in range(warmup):
            fn()
        ms, faults = [], []
        for _ in range(iters):
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t = time.perf_counter()
            fn()
            ms.append((time.perf_counter() - t) * 1e3)
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
        out[name] = {"ms": statistics.median(ms), "faults": statistics.median(faults)}
    return out


def run_one(arm: str, policy: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, TORCHBRIDGE_HOST_ALLOCATOR=policy)
    cmd = [sys.executable, __file__, "--child", arm, "--warmup", str(args.warmup), "--iters", str(args.iters)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise RuntimeError(f"{arm} ({policy}) failed:\n{r.stderr[-2000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if res["policy"] != policy:
        raise RuntimeError(f"{arm}: asked for policy {policy}, the process ran {res['policy']}")
    return res


def table(results: dict) -> str:
    lines = ["| arm | work | keep ms | default ms | default / keep (median, range) | faults per iteration keep / default |",
             "|---|---|---:|---:|---:|---:|"]
    for arm, per in results.items():
        for w in WORK:
            keep = [r[w] for r in per["keep"]]
            dflt = [r[w] for r in per["default"]]
            ratios = [d["ms"] / k["ms"] for k, d in zip(keep, dflt, strict=True)]
            lines.append(
                f"| {arm} | {w} | {statistics.median(x['ms'] for x in keep):.1f} | "
                f"{statistics.median(x['ms'] for x in dflt):.1f} | **{statistics.median(ratios):.2f}x** "
                f"({min(ratios):.2f}-{max(ratios):.2f}) | {statistics.median(x['faults'] for x in keep):.0f} / "
                f"{statistics.median(x['faults'] for x in dflt):.0f} |")
    return "\n".join(lines)


PAIRS = (("fused", "compiled", "fused eager time / bridge compiled time (issue 18: <= 1.25x)"),
         ("inductor", "compiled", "Inductor time / bridge compiled time (bridge speed-up)"))


def ratio_table(results: dict) -> str:
    """Ratios between arms, per policy: each round's two processes paired (median, range over rounds)."""
    lines = ["| ratio | work | keep (median, range) | default (median, range) |", "|---|---|---:|---:|"]
    for num, den, label in PAIRS:
        if num not in results or den not in results:
            continue
        for w in WORK:
            cells = []
            for policy in ("keep", "default"):
                r = [a[w]["ms"] / b[w]["ms"] for a, b in zip(results[num][policy], results[den][policy], strict=True)]
                cells.append(f"{statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})")
            lines.append(f"| {label} | {w} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arms", default=",".join(ARMS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--write", help="append the table as a section of this markdown file")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.warmup, args.iters)))
        return 0
    arms = [a for a in args.arms.split(",") if a]
    unknown = set(arms) - set(ARMS)
    if unknown:
        ap.error(f"unknown arms {sorted(unknown)}; known: {', '.join(ARMS)}")
    load0 = os.getloadavg()
    results: dict = {a: {"keep": [], "default": []} for a in arms}
    for rnd in range(args.rounds):
        for arm in arms:
            # which policy goes first alternates with the round, so neither always runs on a warmer machine
            for policy in (("keep", "default") if rnd % 2 == 0 else ("default", "keep")):
                res = run_one(arm, policy, args)
                results[arm][policy].append(res)
                print(f"round {rnd + 1} {arm:9s} {policy:8s} " + "  ".join(
                    f"{w} {res[w]['ms']:7.1f} ms ({res[w]['faults']:.0f} faults)" for w in WORK), flush=True)
    load1 = os.getloadavg()
    text = table(results)
    ratios = ratio_table(results)
    if ratios:
        text += "\n\nBetween arms, each arm in its own process (no other model's allocations in its heap):\n\n" + ratios
    print(text)
    if args.write:
        cmd = "python bench/bench_host_allocator.py " + " ".join(a for a in (argv or sys.argv[1:]) if a)
        section = (f"\n## Host allocator policy: kept memory vs glibc's defaults\n\nCommand: `{cmd}`; load average "
                   f"{' '.join(f'{x:.2f}' for x in load0)} before, {' '.join(f'{x:.2f}' for x in load1)} after. "
                   f"Each cell a fresh process per round ({args.warmup} warm-up, median of {args.iters}); batch 8 x 128, "
                   f"the compile bench's Llama.\n\n{text}\n")
        with open(args.write, "a") as f:
            f.write(section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
