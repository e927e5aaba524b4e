"""Prompts from their first token: unpadded causal attention per prompt vs the gathered, masked group.

The engine on the CPU gives each prompt computed from its first token its own causal attention call over
its own keys and values (attention.FreshPrefillGroup); before, every prefill of a step went into one masked
call over keys gathered from the paged cache, each prompt padded to the step's longest. One process, one
torch thread, the bench model (bench_serve.py's random Llama); the two settings alternated per round
(`ModelRunner.fresh_prefill`), on prefill-only requests (max_tokens=1) and on the whole bench workload, for
the bench's prompt lengths and for a wider spread. Ratio = masked / fresh time (> 1: fresh faster).

    python bench/bench_serve_prefill.py [--dtype bfloat16] [--rounds 6] [--write docs/benchmarks/F.md]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench_serve import make_model, make_requests
from bench_serve_kernels import cpu_name

PROMPTS = [(32, 128), (16, 512)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--write", type=Path, default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from torchbridge.serve import LLM, SamplingParams

    model_dir = Path(tempfile.mkdtemp()) / "bench-llama"
    make_model(model_dir)
    llm = LLM(str(model_dir), max_num_seqs=32, max_model_len=1024, enable_prefix_caching=False, dtype=args.dtype)
    llm.generate([[5] * 8], SamplingParams(temperature=0, max_tokens=2))
    rows = []
    for lo, hi in PROMPTS:
        reqs, outs = make_requests(64, [lo, hi], [16, 128], 0)
        for name, params in (("prefill only", [SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)] * 64),
                             ("whole workload", [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                                 for n in outs])):
            times: dict[bool, list[float]] = {True: [], False: []}
            for r in range(args.rounds):  # alternated, the order flipped every other round
                fresh = (r % 2 == 0) ^ (r % 4 >= 2)
                llm.engine.runner.fresh_prefill = fresh
                t0 = time.perf_counter()
                llm.generate(reqs, params)
                times[fresh].append(time.perf_counter() - t0)
            ratios = [a / b for a, b in zip(times[False], times[True], strict=True)]
            rows.append((f"{lo}-{hi}", name, statistics.median(times[False]), statistics.median(times[True]), ratios))
            print(f"prompts {lo}-{hi} {name}: masked {rows[-1][2]:.3f} s, fresh {rows[-1][3]:.3f} s, "
                  f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})", flush=True)
    if args.write:
        lines = ["# Prefill attention: unpadded per prompt vs the masked group", "",
                 f"Command: `python bench/bench_serve_prefill.py --dtype {args.dtype} --rounds {args.rounds} "
                 f"--write {args.write}`", "",
                 f"Machine: {cpu_name()}, torch {torch.__version__}, 1 thread; bench model, {args.dtype}, 64 requests "
                 "at 32 concurrent; settings alternated in one process, medians over rounds.", "",
                 "| prompt tokens | requests | masked s | fresh s | masked / fresh (range) |", "|---|---|---:|---:|---:|"]
        lines += [f"| {p} | {n} | {m:.3f} | {f:.3f} | {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f}) |"
                  for p, n, m, f, r in rows]
        args.write.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
