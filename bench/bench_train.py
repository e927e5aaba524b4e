"""Training on the device: MFU of the compiled step, tokens/s over 1-8 ranks, and a scaling model.

    python bench/bench_train.py [--rounds 5] [--steps 3] [--ranks 1 2 4 8] [--parts mfu,ranks,model]
                                [--write docs/benchmarks/train.md]

MFU (part "mfu"): the CPU's peak is measured here, by the best of several large GEMMs through PyTorch
(2048^3 in float32 and in bfloat16). The model is a ~16M-parameter Llama (bench_compile.py's shape:
Hugging Face LlamaForCausalLM, 6 layers, hidden 384, vocab 8192), batch 8 x 128 tokens, AdamW. Two
arms in one process, taking turns within every round: the bridge (model and optimizer step
compiled with backend "tpu", on the device) and torch.compile with Inductor (model and optimizer step,
CPU tensors). Model FLOPs per step = 6 x (parameters without the input embedding) x tokens + 12 x
layers x hidden x sequence x tokens (attention scores and values, forward and backward, PaLM's
convention, no discount for the causal mask). MFU = FLOPs per step / step time / fp32 peak.

Ranks (part "ranks"): the same-sized Llama written as TorchTitan writes it (tests/distributed/workers/
tiny_llama.py) with FSDP2 over 1, 2, 4, 8 ranks (torchrun, one emulated chip per rank, one core per
rank as far as there are cores), each block compiled with backend "tpu", 4 x 128 tokens per rank per
step (weak scaling). Tokens/s = ranks x tokens per rank / step time. The collectives of one step are
recorded at the process group (kind and size of every all-gather, reduce-scatter and all-reduce FSDP2
issues), then each is replayed alone and timed to completion: their sum over the step time is the
share of the step spent in collectives (an upper bound on the exposed share: FSDP2 overlaps some of
it with compute). With more ranks than cores the ranks share cores, so the figures measure the
emulation, not chips; they are what the scaling model is fitted to.

Scaling model (part "model", documented in docs/benchmarks/train.md): a collective of b bytes per rank
over a ring of n ranks costs alpha x hops + b x (n - 1) / n / beta. alpha and beta are fitted (least
squares) to the replayed collectives of the "ranks" part (the emulated machine); for TPUs the model
takes published per-chip figures instead (bf16 peak, ICI bandwidth) and an assumed per-hop latency,
and predicts the step time and scaling efficiency of an 8B Llama (Llama-3-8B's shape) from 8 to 8,192
chips for FSDP and FSDP + TP, at a fixed per-chip batch and at a fixed global batch.

Every run records the machine's load average before and after; numbers from a busy machine say so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# ---- peak ----------------------------------------------------------------------------------------
def gemm_peak(dtype_name: str, n: int = 2048, reps: int = 5) -> float:
    """FLOP/s of the best of `reps` n x n x n products through PyTorch's CPU GEMM (all cores)."""
    import torch

    dtype = getattr(torch, dtype_name)
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = math.inf
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


# ---- MFU -----------------------------------------------------------------------------------------
def llama_flops_per_step(params_no_embedding: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    return 6 * params_no_embedding * tokens + 12 * layers * hidden * seq * tokens


def part_mfu(rounds: int, steps: int, batch: int = 8, seq: int = 128) -> dict:
    import torch
    import transformers

    import torchbridge

    dev = torchbridge.device_name()
    cfg = transformers.LlamaConfig(vocab_size=8192, hidden_size=384, intermediate_size=1024, num_hidden_layers=6,
                                   num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in base.parameters())
    n_no_emb = n_params - base.model.embed_tokens.weight.numel()
    flops = llama_flops_per_step(n_no_emb, cfg.num_hidden_layers, cfg.hidden_size, seq, batch * seq)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    arms = {}
    for arm, device, backend in (("bridge", dev, "tpu"), ("inductor", "cpu", "inductor")):
        import copy

        model = copy.deepcopy(base).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        arms[arm] = (torch.compile(model, backend=backend), opt, torch.compile(opt.step, backend=backend),
                     ids.to(device), device)

    def step(arm: str) -> float:
        model, opt, opt_step, x, device = arms[arm]
        opt.zero_grad()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        opt_step()
        return loss.item()  # waits for the step on either device

    losses = {arm: [step(arm) for _ in range(3)][-1] for arm in arms}  # warm-up: compiles
    times: dict[str, list[float]] = {arm: [] for arm in arms}
    for _ in range(rounds):
        for arm in arms:
            t = time.perf_counter()
            for _ in range(steps):
                step(arm)
            times[arm].append((time.perf_counter() - t) / steps)
    return {"params": n_params, "params_no_embedding": n_no_emb, "flops_per_step": flops, "batch": batch,
            "seq": seq, "times": times, "losses": losses}


def peak_flops() -> dict[str, float]:
    peaks = {d: [gemm_peak(d) for _ in range(3)] for d in ("float32", "bfloat16")}
    return {d: max(v) for d, v in peaks.items()}


# ---- ranks ---------------------------------------------------------------------------------------
def _pin_to_core() -> None:
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[int(os.environ["LOCAL_RANK"]) % len(cores)]})


def worker_ranks(out: Path, rounds: int, steps: int) -> None:
    _pin_to_core()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchbridge.distributed import process_group

    sys.path.insert(0, str(ROOT / "tests" / "distributed" / "workers"))
    import tiny_llama

    tiny_llama.use_bench_shape()
    dist.init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("tpu", int(os.environ["LOCAL_RANK"]))
    torch.tpu.set_device(dev)
    torch.manual_seed(0)
    model = tiny_llama.TinyLlama().to(dev)
    mesh = init_device_mesh("tpu", (world,))
    for block in model.layers:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for block in model.layers:
        block.compile(backend="tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, tiny_llama.VOCAB, (4, 129), generator=torch.Generator().manual_seed(rank)).to(dev)
    x, y = tokens[:, :-1], tokens[:, 1:]

    def step() -> float:
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()

    for _ in range(3):
        step()
    # one step's collectives, as FSDP2 issues them to the device's process group
    calls: list[tuple[str, int, str]] = []
    pg_cls = process_group.DeviceProcessGroup
    # method -> (kind, the inputs of a call: the shard gathered / the full gradient reduced). FSDP2 in
    # torch 2.13 calls the group's all_gather_single / reduce_scatter_single, which do not come back
    # through the Python `_allgather_base` / `_reduce_scatter_base` (recording those saw 0 per step)
    recorded = {"all_gather_single": ("all_gather", lambda a: [a[1]]),
                "reduce_scatter_single": ("reduce_scatter", lambda a: [a[1]]),
                "allreduce": ("all_reduce", lambda a: list(a[0]))}
    originals = {name: getattr(pg_cls, name) for name in recorded}

    def recorder(name: str):
        kind, inputs = recorded[name]

        def call(self, *args, **kwargs):
            for t in inputs(args):
                calls.append((kind, t.numel(), str(t.dtype).removeprefix("torch.")))
            return originals[name](self, *args, **kwargs)
        return call

    for name in recorded:
        setattr(pg_cls, name, recorder(name))
    step()
    for name, fn in originals.items():
        setattr(pg_cls, name, fn)
    if world > 1 and not calls:
        raise RuntimeError("bench_train ranks: no collective recorded in an FSDP2 step (which c10d method does "
                           "FSDP2 call in this torch?)")
    times = []
    for _ in range(rounds):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - t) / steps)
    # each recorded collective alone, timed to completion (median of 5)
    replay: dict[str, float] = {}
    for kind, numel, dtype in sorted(set(calls)):
        inp = torch.ones(numel, dtype=getattr(torch, dtype), device=dev)
        outp = torch.empty(numel * world if kind == "all_gather" else max(1, numel // world), dtype=inp.dtype, device=dev)
        fn = {"all_gather": lambda o=outp, i=inp: dist.all_gather_single(o, i),
              "reduce_scatter": lambda o=outp, i=inp: dist.reduce_scatter_single(o, i),
              "all_reduce": lambda i=inp: dist.all_reduce(i)}[kind]
        fn()
        torch.tpu.synchronize()
        samples = []
        for _ in range(5):
            dist.barrier()
            t = time.perf_counter()
            fn()
            torch.tpu.synchronize()
            samples.append(time.perf_counter() - t)
        replay[f"{kind}/{numel}/{dtype}"] = statistics.median(samples)
    if rank == 0:
        (out / f"ranks{world}.json").write_text(json.dumps({
            "world": world, "tokens_per_rank": x.numel(), "times": times, "calls": calls, "replay": replay,
            "params": sum(p.numel() for p in model.parameters()) * world}))
    dist.destroy_process_group()


def part_ranks(ranks: list[int], rounds: int, steps: int, tmp: Path) -> dict[int, dict]:
    results = {}
    for n in ranks:
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "OMP_NUM_THREADS": "1",
               "TORCHBRIDGE_COMPILE_CACHE_MIN_SECS": "0"}
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}", "--master-addr=127.0.0.1",
               f"--master-port={29700 + n}", __file__, "--worker", "ranks", "--out", str(tmp), "--rounds",
               str(rounds), "--steps", str(steps)]
        subprocess.run(cmd, env=env, check=True, timeout=3600)
        results[n] = json.loads((tmp / f"ranks{n}.json").read_text())
    return results


def collective_share(r: dict) -> tuple[float, float]:
    """(seconds per step in collectives when each runs alone, that over the median step time)."""
    per_call = {tuple(k.split("/")): v for k, v in r["replay"].items()}
    total = sum(per_call[(kind, str(numel), dtype)] for kind, numel, dtype in r["calls"])
    return total, total / statistics.median(r["times"])


# ---- scaling model -------------------------------------------------------------------------------
def fit_alpha_beta(ranks: dict[int, dict]) -> tuple[float, float] | None:
    """Least squares of t = alpha x (n - 1) + bytes x (n - 1) / n / beta, alpha >= 0 and beta > 0, over the
    replayed collectives of the rank counts that have a core each (with more ranks than cores the
    replay times the sharing of cores, and an unconstrained fit over them gave a negative alpha)."""
    rows, ys = [], []
    cores = len(os.sched_getaffinity(0))
    usable = [n for n in ranks if 2 <= n <= cores] or [n for n in ranks if n >= 2]
    for n, r in ranks.items():
        if n not in usable:
            continue
        for key, t in r["replay"].items():
            kind, numel, dtype = key.split("/")
            itemsize = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}.get(dtype, 4)
            size = int(numel) * itemsize * (n if kind == "all_gather" else 1)  # the full buffer
            factor = 2 if kind == "all_reduce" else 1  # ring all-reduce = reduce-scatter + all-gather
            rows.append((factor * (n - 1), factor * size * (n - 1) / n))
            ys.append(t)
    if len(rows) < 2:
        return None
    sxx = sum(a * a for a, _ in rows)
    sxy = sum(a * b for a, b in rows)
    syy = sum(b * b for _, b in rows)
    tx = sum(a * y for (a, _), y in zip(rows, ys, strict=True))
    ty = sum(b * y for (_, b), y in zip(rows, ys, strict=True))
    det = sxx * syy - sxy * sxy
    if det == 0:
        return None
    alpha = (tx * syy - ty * sxy) / det
    inv_beta = (sxx * ty - sxy * tx) / det
    if alpha < 0:  # the constrained optimum lies on alpha = 0
        alpha, inv_beta = 0.0, ty / syy
    elif inv_beta <= 0:  # ... or on 1 / beta = 0
        alpha, inv_beta = tx / sxx, 0.0
    return alpha, (1 / inv_beta if inv_beta > 0 else math.inf)


# Published per-chip figures (Google Cloud TPU documentation / Ironwood announcement, 2025): bf16 dense
# peak and inter-chip interconnect bandwidth (bidirectional, all links). One direction of a ring uses
# half of a chip's links' bandwidth at best; the model takes ICI / 2 per direction per collective.
TPUS = {
    "v5p": {"peak": 459e12, "ici": 4800e9 / 8, "hbm": 95e9},           # 4,800 Gbps ICI per chip
    "ironwood": {"peak": 2307e12, "ici": 1.2e12, "hbm": 192e9},        # 4,614 TFLOPS fp8 -> ~2,307 bf16; 1.2 TB/s ICI
}
HOP_LATENCY = 2e-6  # assumed seconds per ring hop on ICI (not published; the model shows its effect)
LLAMA_8B = {"params": 8.03e9, "layers": 32, "hidden": 4096, "seq": 8192, "vocab": 128256}


def torus_hops(n: int) -> int:
    """Hops of one ring collective on a 3-d torus of n chips using its dimensions one after another
    (TPU pods are 3-d tori; e.g. 8,192 = 16 x 16 x 32 -> 15 + 15 + 31 hops), versus n - 1 on a flat ring."""
    dims = [1, 1, 1]
    k = 0
    m = n
    while m > 1:
        dims[k % 3] *= 2
        m //= 2
        k += 1
    return sum(d - 1 for d in dims)


def predict(chips: int, tp: int, tokens_per_chip: float, tpu: dict, mfu: float, hop: float = HOP_LATENCY) -> dict:
    """Step time and its parts for the 8B model on `chips` chips: FSDP over chips / tp, TP inside tp chips."""
    m = LLAMA_8B
    fsdp = chips // tp
    # a TP group of tp chips shares tp x tokens_per_chip tokens and the model: per chip the FLOPs of its tokens
    compute = 6 * m["params"] * tokens_per_chip + 12 * m["layers"] * m["hidden"] * m["seq"] * tokens_per_chip
    t_compute = compute / (tpu["peak"] * mfu)
    bw = tpu["ici"] / 2  # one direction
    # FSDP: all-gather bf16 params forward and again for backward, reduce-scatter fp32 gradients; each
    # chip holds params / tp of the model, and per layer one collective of each kind
    shard_bytes = m["params"] / tp
    hops = torus_hops(fsdp)
    per_layer = 3 * m["layers"]
    t_fsdp = 0.0
    if fsdp > 1:
        t_fsdp = (shard_bytes * (2 + 2 + 4)) * (fsdp - 1) / fsdp / bw + per_layer * hops * hop
    # TP with sequence parallelism: per layer 2 all-gathers + 2 reduce-scatters of the activations forward,
    # as many backward; activations bf16 [tokens x hidden] per TP group
    t_tp = 0.0
    if tp > 1:
        act = tokens_per_chip * tp * m["hidden"] * 2
        t_tp = 8 * m["layers"] * (act * (tp - 1) / tp / bw + (tp - 1) * hop)
    # FSDP's prefetched all-gathers and its reduce-scatters overlap with compute (at best fully); TP's
    # collectives sit between the products that need them (no asynchronous TP assumed)
    t_exposed = max(t_compute, t_fsdp) + t_tp
    return {"compute": t_compute, "fsdp": t_fsdp, "tp": t_tp, "step": t_exposed,
            "efficiency": t_compute / t_exposed, "hops": hops}


def model_table(tpu_name: str, mfu: float) -> list[str]:
    tpu = TPUS[tpu_name]
    lines = [f"8B Llama on {tpu_name} (bf16 peak {tpu['peak'] / 1e12:.0f} TFLOPS, ICI {tpu['ici'] / 1e9:.0f} GB/s "
             f"per chip, {HOP_LATENCY * 1e6:.0f} us per hop assumed), compute at {mfu:.0%} MFU:", "",
             "| chips | layout | tokens/chip | compute (s) | FSDP comm (s) | TP comm (s) | step (s) | efficiency |",
             "|---:|---|---:|---:|---:|---:|---:|---:|"]
    for chips in (8, 64, 512, 1024, 2048, 4096, 8192):
        for tp, label in ((1, "FSDP"), (8, "FSDP x TP8")):
            if chips < tp:
                continue
            for regime, tpc in (("8,192 tokens/chip", 8192.0), ("4M-token global batch", 4 * 2**20 / chips)):
                if tpc > 8192:  # more would be gradient accumulation: the per-chip rows apply
                    continue
                p = predict(chips, tp, tpc, tpu, mfu)
                lines.append(f"| {chips:,} | {label}, {regime} | {tpc:,.0f} | {p['compute']:.3f} | {p['fsdp']:.3f} "
                             f"| {p['tp']:.3f} | {p['step']:.3f} | {p['efficiency']:.0%} |")
    return lines


# ---- driver --------------------------------------------------------------------------------------
def _ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    r = sorted(x / y for x, y in zip(a, b, strict=True))
    return statistics.median(r), r[0], r[-1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--parts", default="mfu,ranks,model")
    ap.add_argument("--shapes", default="8x128",
                    help="batch x sequence of the mfu part, comma-separated (8x128 is the headline shape)")
    ap.add_argument("--write", default=None)
    ap.add_argument("--worker", choices=["ranks"], help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker == "ranks":
        worker_ranks(Path(args.out), args.rounds, args.steps)
        return 0
    parts = set(args.parts.split(","))
    load_before = os.getloadavg()
    cmd = "python bench/bench_train.py " + " ".join(argv if argv is not None else sys.argv[1:])
    lines: list[str] = []
    mfu_bridge = None
    if "mfu" in parts:
        shapes = [tuple(int(v) for v in sh.split("x")) for sh in args.shapes.split(",")]
        results = [part_mfu(args.rounds, args.steps, b, q) for b, q in shapes]
        peak = peak_flops()
        r0 = results[0]
        lines += ["## MFU of the compiled training step", "",
                  f"Llama {r0['params'] / 1e6:.1f}M parameters ({r0['params_no_embedding'] / 1e6:.1f}M without the input "
                  f"embedding), AdamW. Peak measured here: fp32 {peak['float32'] / 1e9:.1f} GFLOP/s, bf16 "
                  f"{peak['bfloat16'] / 1e9:.1f} GFLOP/s (best 2048^3 GEMM). {args.rounds} rounds x {args.steps} steps "
                  "per shape, arms alternated.", "",
                  "| batch x seq | GFLOP/step | arm | step (median ms) | range (ms) | MFU vs fp32 peak | MFU vs bf16 peak "
                  "| loss after warm-up |",
                  "|---|---:|---|---:|---:|---:|---:|---:|"]
        names = {"bridge": 'bridge: torch.compile(backend="tpu"), device', "inductor": "torch.compile (Inductor), CPU"}
        ratios = []
        for r in results:
            t = r["times"]
            for arm in ("bridge", "inductor"):
                med = statistics.median(t[arm])
                lines.append(f"| {r['batch']} x {r['seq']} | {r['flops_per_step'] / 1e9:.1f} | {names[arm]} | "
                             f"{med * 1e3:.1f} | {min(t[arm]) * 1e3:.1f}-{max(t[arm]) * 1e3:.1f} | "
                             f"{r['flops_per_step'] / med / peak['float32']:.1%} | "
                             f"{r['flops_per_step'] / med / peak['bfloat16']:.1%} | {r['losses'][arm]:.4f} |")
            ratios.append((r, _ratio(t["inductor"], t["bridge"])))
        mfu_bridge = r0["flops_per_step"] / statistics.median(r0["times"]["bridge"]) / peak["float32"]
        lines += ["", "Bridge vs Inductor (Inductor step time / bridge step time, median and range over rounds): "
                  + "; ".join(f"{r['batch']} x {r['seq']}: {sp[0]:.2f}x ({sp[1]:.2f}-{sp[2]:.2f}x)" for r, sp in ratios)
                  + ".", ""]
    ranks: dict[int, dict] = {}
    if "ranks" in parts:
        with tempfile.TemporaryDirectory() as tmp:
            ranks = part_ranks(args.ranks, args.rounds, args.steps, Path(tmp))
        base = None
        lines += ["## Tokens per second over ranks (FSDP2, compiled blocks, emulated chips)", "",
                  f"{os.cpu_count()} cores; 4 x 128 tokens per rank per step; {args.rounds} rounds x {args.steps} steps.", "",
                  "| ranks | step (median ms) | tokens/s | vs 1 rank | collectives per step | collective time alone (ms) | share of step |",
                  "|---:|---:|---:|---:|---:|---:|---:|"]
        for n, r in sorted(ranks.items()):
            med = statistics.median(r["times"])
            tps = n * r["tokens_per_rank"] / med
            base = base or tps
            coll, share = collective_share(r)
            lines.append(f"| {n} | {med * 1e3:.1f} | {tps:,.0f} | {tps / base:.2f}x | {len(r['calls'])} | "
                         f"{coll * 1e3:.1f} | {share:.0%} |")
        fit = fit_alpha_beta(ranks)
        if fit:
            lines += ["", f"Fitted to the replayed collectives (ring model, t = alpha x hops + bytes x (n-1)/n / beta): "
                      f"alpha = {fit[0] * 1e6:.1f} us per hop, beta = {fit[1] / 1e9:.2f} GB/s (this machine's emulated chips)."]
        lines.append("")
    if "model" in parts:
        lines += ["## Scaling model: 8B Llama, 8 to 8,192 chips", ""]
        for tpu_name in ("ironwood", "v5p"):
            lines += model_table(tpu_name, 0.52) + [""]
    load_after = os.getloadavg()
    header = [f"Command: `{cmd.strip()}`", "",
              f"Machine: {os.cpu_count()} cores; load average {load_before[0]:.2f} / {load_before[1]:.2f} / "
              f"{load_before[2]:.2f} before, {load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f} after; "
              f"{time.strftime('%Y-%m-%d %H:%M')}.", ""]
    text = "\n".join(header + lines) + "\n"
    print(text)
    if mfu_bridge is not None:
        print(f"bridge MFU (fp32 peak): {mfu_bridge:.1%}")
    if args.write:
        path = Path(args.write)
        old = path.read_text() if path.exists() else ""
        marker = "<!-- bench output -->"
        head = old.split(marker)[0] if marker in old else old
        path.write_text(head.rstrip("\n") + f"\n\n{marker}\n\n" + text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
