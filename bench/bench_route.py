"""Router benchmark: five routing arms on an agentic and a shared-prefix workload.

  sim   the discrete-event simulator (the router's real picker code) at --sim-replicas replicas,
        replica model calibrated from our engine (CALIBRATED below, or --calibrate URL);
  real  --real N engine replicas of `torchbridge serve` on this machine behind the real proxy.

Default (`python bench/bench_route.py`): sim only, 1,000 replicas. Real replicas:
`python bench/bench_route.py --no-sim --real 4 --model DIR`. The tables print; the PNG plots go next
to docs/benchmarks/route.md; the raw per-request results (megabytes per run) go to --raw-dir,
~/.cache/torchbridge/bench-route by default, outside the repository.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import secrets
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCHBRIDGE_NO_DEVICE", "1")

from torchbridge.route.config import parse_config  # noqa: E402
from torchbridge.route.index import block_hashes  # noqa: E402
from torchbridge.route.picker import EndpointPicker  # noqa: E402
from torchbridge.route.simulator import (  # noqa: E402
    AgenticWorkload,
    ReplicaModel,
    SharedPrefixWorkload,
    SimRequest,
    Simulator,
    dedicated_route,
    run_agentic,
    run_shared_prefix,
    summarize,
)

ARMS = ["round-robin", "random", "least-loaded", "prefix-aware", "sticky"]
# Not a router: every session alone on a replica of its own (simulator.dedicated_route), the bound no
# routing of the same sessions can beat (simulator only; it uses 4 replicas per concurrent session).
DEDICATED = "dedicated"
SIM_ARMS = [*ARMS, DEDICATED]
OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
RAW = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchbridge" / "bench-route"

# Measured with torchbridge.route.calibrate (context_words 500 .. 5,500, i.e. prompts of 87 to 29,414
# tokens) on one `torchbridge serve --device cpu --max-model-len 32768` replica of the bundled
# 4M-parameter Llama with max_position_embeddings raised to 32,768 (same weights; timing does not
# depend on what the weights say), OMP_NUM_THREADS=1, on a quiet machine (2026-11-30):
# 8,275 prompt tok/s plus 5.4e-8 s per query-key pair of attention (a 29k-token prompt: 29.5 s, of
# which 3.6 s is the per-token part); decode step 2.7 ms + 0.97 ms per sequence + 0.48 us per
# context token (17.8 ms at batch 1 after a 29k-token prompt, 3.6 ms after 87 tokens);
# 32,768 KV blocks of 16 tokens (the engine's default sizing at --max-model-len 32768: min(64 x
# 32,768, 2 GiB / 4 KiB per token) = 524,288 tokens; this model in fp32 stores 2 x 4 layers x 2 KV
# heads x 64 dims x 4 bytes = 4 KiB per token); --max-num-seqs 64 and --max-num-batched-tokens 1024
# are the engine's defaults (serve/config.py). `--flat-attention` drops the two attention terms
# (every token costs the same at any context: the replica model of the runs before 2026-11-30,
# which had 4,895 tok/s and 5.6 ms + 1.9 ms per sequence, measured 2026-11-29 with prompts of up to
# ~700 tokens at the model's own 1,024 positions).
CALIBRATED = dict(prefill_tps=8275.0, decode_base_s=0.00266, decode_per_seq_s=0.00097, kv_blocks=32768,
                  block_size=16, max_batch=64, max_batched_tokens=1024, prefill_attn_s=5.4e-8,
                  decode_attn_s=4.83e-7)
# The agentic workload's contexts reach ~32k tokens: the measured pool above.
AGENTIC_KV_TOKENS = 524_288
# Shared-prefix keeps the measured pool (4,096 x 16 = 65,536 tokens), as in its earlier runs. Its
# 3,250-token sequences need --max-model-len 4096, for which the default sizing rule would give
# min(64 x 4,096, 2 GiB / 4 KiB) = 262,144 tokens (--sp-kv-tokens 262144).
SHARED_PREFIX_KV_TOKENS = 65_536


def sim_model(sim_block: int, cal: dict[str, float], kv_tokens: int | None = None) -> ReplicaModel:
    """The calibrated replica, with KV counted in the simulator's (coarser) blocks."""
    kv_tokens = kv_tokens or int(cal["kv_blocks"] * cal["block_size"])
    mbt = cal.get("max_batched_tokens")
    return ReplicaModel(prefill_tps=cal["prefill_tps"], decode_base_s=cal["decode_base_s"],
                        decode_per_seq_s=cal["decode_per_seq_s"], kv_blocks=int(kv_tokens // sim_block),
                        block_size=sim_block, max_batch=int(cal["max_batch"]),
                        max_batched_tokens=int(mbt) if mbt else None,
                        prefill_attn_s=cal.get("prefill_attn_s", 0.0), decode_attn_s=cal.get("decode_attn_s", 0.0))


def sim_run(workload: str, arm: str, n_replicas: int, concurrency: int, seed: int, duration: float,
            warmup: float, sim_block: int, cal: dict[str, float], wl: AgenticWorkload | None = None,
            kv_tokens: int | None = None, scrape_interval_s: float = 1.0) -> dict[str, Any]:
    if arm == DEDICATED and workload != "agentic":
        raise ValueError(f"{DEDICATED!r} needs sessions: agentic workload only")
    n_sim = 4 * concurrency if arm == DEDICATED else n_replicas
    picker = EndpointPicker(parse_config({"router": {"block_size": sim_block}}), seed=seed, capacity=n_sim)
    model = sim_model(sim_block, cal, kv_tokens)
    sim = Simulator(picker, {f"r{i}": model for i in range(n_sim)}, arm, scrape_interval_s=scrape_interval_s)
    if arm == DEDICATED:
        sim.route = dedicated_route(sim)
    t0 = time.perf_counter()
    if workload == "agentic":
        res = run_agentic(sim, wl or AgenticWorkload(), concurrency, duration, warmup, seed)
    else:
        res = run_shared_prefix(sim, SharedPrefixWorkload(groups=max(8, n_replicas // 4)), concurrency, duration,
                                warmup, seed)
    s = summarize(res)
    win = [r for r in res.requests if warmup <= r.arrival < duration]
    done = [r for r in res.requests if warmup <= r.finish < duration]
    s.update(workload=workload, arm=arm, replicas=n_replicas, concurrency=concurrency, seed=seed,
             wall_s=time.perf_counter() - t0, ttfts=sorted(round(r.ttft, 4) for r in win),
             tpot_mean=statistics.fmean((r.finish - r.first_token) / max(1, r.max_tokens - 1) for r in done)
             if done else math.nan,
             evicted_blocks=res.evicted_blocks, prefill_tokens=res.prefill_tokens)
    return s


def run_sim(args: argparse.Namespace, cal: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    n = args.sim_replicas
    wl = AgenticWorkload(system_tokens=args.system_tokens, session_tokens=args.session_tokens,
                         first_user_tokens=args.input_tokens, tool_tokens=args.input_tokens,
                         output_tokens=args.output_tokens, tool_latency_mean_s=args.tool_latency_mean)
    for workload in args.workloads:
        if workload == "agentic":
            sat = int(round(args.sat_per_replica * n))
            levels = sorted({int(round(c * n)) for c in args.sim_per_replica} | {sat})
            kv, dur, warm = args.kv_tokens, args.sim_duration, args.sim_warmup
        else:
            sat = int(round(args.sp_sat_per_replica * n))
            levels = sorted({int(round(c * n)) for c in args.sp_per_replica} | {sat})
            kv, dur, warm = args.sp_kv_tokens, args.sp_duration, args.sp_warmup
        for c in levels:
            at_sat = c == sat
            arms = [a for a in SIM_ARMS if a in (args.arms if at_sat else args.sweep_arms)]
            for arm in arms:
                seeds = range(args.first_seed, args.first_seed + args.seeds) if at_sat else [args.first_seed]
                for seed in seeds:
                    r = sim_run(workload, arm, n, c, seed, dur, warm, args.sim_block, cal, wl, kv, args.scrape_interval)
                    rows.append(r)
                    print(f"sim {workload:8s} n={n} c={c:5d} {arm:13s} seed={seed} ttft_mean={r['ttft_mean']:.3f}s "
                          f"p50={r['ttft_p50']:.3f}s tok/s={r['total_tps']:.0f} tpot={r['tpot_mean'] * 1e3:.0f}ms "
                          f"hit={r['prefix_hit_ratio']:.2f} dec_p50={r['decision_p50_us']:.0f}us ({r['wall_s']:.0f}s)",
                          flush=True)
    return rows


# ---------------------------------------------------------------------------------------------
# Real replicas


async def _agentic_client(client: Any, url: str, arm: str, sid: str, rng: random.Random, deadline: float,
                          warmup_end: float, out: list[dict[str, Any]], system: str, max_context_chars: int,
                          output_tokens: int) -> None:
    context = system
    turn = 0
    while time.monotonic() < deadline:
        turn += 1
        context += f"\n# turn {turn} of {sid}: tool output {rng.random():.8f}\n" + "x = foo(bar)\n" * rng.randint(2, 6)
        if len(context) > max_context_chars:  # the small model has 1,024 positions: start a new session
            context = system + f"\n# new session {sid}-{turn}\n"
        body = {"prompt": context, "max_tokens": output_tokens, "stream": True, "temperature": 0.0,
                "ignore_eos": True}
        t0 = time.monotonic()
        first = None
        n_out = 0
        text = []
        try:
            async with client.stream("POST", url + "/v1/completions", json=body,
                                     headers={"x-route-profile": arm, "x-session-id": sid}) as r:
                if r.status_code != 200:
                    await r.aread()
                    await asyncio.sleep(0.1)
                    continue
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        if first is None:
                            first = time.monotonic()
                        obj = json.loads(line[6:])
                        if obj.get("choices"):
                            n_out += 1
                            text.append(obj["choices"][0].get("text", ""))
        except Exception:  # noqa: BLE001 - a failed request is recorded as missing, not fatal
            continue
        t1 = time.monotonic()
        if first is not None and t0 >= warmup_end:
            out.append({"ttft": first - t0, "end": t1, "prompt": context, "out_tokens": n_out})
        context += "".join(text)
        await asyncio.sleep(min(5.0, rng.lognormvariate(math.log(0.3), 0.6)))  # tool latency


async def _real_arm(url: str, arm: str, concurrency: int, seed: int, duration: float, warmup: float,
                    output_tokens: int, count_tokens: Any) -> dict[str, Any]:
    import httpx

    rng = random.Random(seed)
    # Fresh content per (arm, seed): earlier arms' cached prefixes cannot help this one.
    system = f"# system prompt {arm} {seed} {rng.random()}\n" + "def helper(x):\n    return x * 2\n" * 20
    out: list[dict[str, Any]] = []
    start = time.monotonic()
    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(_agentic_client(client, url, arm, f"{arm}-{seed}-{i}", random.Random(seed * 997 + i),
                                               start + duration, start + warmup, out, system, 1800, output_tokens)
                               for i in range(concurrency)))
    win = duration - warmup
    ttft = sorted(o["ttft"] for o in out) or [math.nan]
    prompt_tokens = sum(count_tokens(o["prompt"]) for o in out)
    out_tokens = sum(o["out_tokens"] for o in out)
    return {"arm": arm, "concurrency": concurrency, "seed": seed, "requests": len(out),
            "ttft_mean": statistics.fmean(ttft), "ttft_p50": ttft[len(ttft) // 2],
            "ttft_p90": ttft[int(0.9 * (len(ttft) - 1))], "total_tps": (prompt_tokens + out_tokens) / win,
            "output_tps": out_tokens / win, "ttfts": [round(t, 4) for t in ttft]}


def run_real(args: argparse.Namespace) -> list[dict[str, Any]]:
    import httpx

    from torchbridge.route.cli import _stop, _wait_healthy, free_port

    if args.model:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)

        def count_tokens(text: str) -> int:
            return len(tok.encode(text))
    else:
        def count_tokens(text: str) -> int:
            return round(len(text) / 2.3)  # the bundled model's BPE averages ~2.3 chars/token on code

    procs: list[subprocess.Popen[bytes]] = []
    rows = []
    try:
        urls = []
        env = {**os.environ, "TORCHBRIDGE_NO_DEVICE": "1"}
        for _ in range(args.real):
            port = free_port()
            cmd = [sys.executable, "-m", "torchbridge", "serve", "--device", "cpu", "--port", str(port),
                   *(["--model", args.model] if args.model else [])]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env))
            urls.append(f"http://127.0.0.1:{port}")
        for u, p in zip(urls, procs, strict=True):
            if not _wait_healthy(u, p, 300):
                raise RuntimeError(f"engine at {u} did not become healthy")
        rport = free_port()
        rcmd = [sys.executable, "-m", "torchbridge", "route", "--port", str(rport),
                *(["--model", args.model] if args.model else []), *sum((["--replica", u] for u in urls), [])]
        procs.append(subprocess.Popen(rcmd, env=env))
        rurl = f"http://127.0.0.1:{rport}"
        if not _wait_healthy(rurl, procs[-1], 60):
            raise RuntimeError("router did not become healthy")
        for c in args.real_concurrency:
            for arm in ARMS:
                for seed in range(args.real_seeds):
                    r = asyncio.run(_real_arm(rurl, arm, c, seed, args.real_duration, args.real_warmup,
                                              args.real_output_tokens, count_tokens))
                    r["replicas"] = args.real
                    rows.append(r)
                    print(f"real n={args.real} c={c:3d} {arm:13s} seed={seed} ttft_mean={r['ttft_mean']:.3f}s "
                          f"p90={r['ttft_p90']:.3f}s tok/s={r['total_tps']:.0f} req={r['requests']}", flush=True)
        m = httpx.get(rurl + "/metrics").text
        dec = [line for line in m.splitlines() if line.startswith("router_decision_latency_seconds_")]
        rows.append({"router_metrics": dec})
    finally:
        _stop(procs)
    return rows


# ---------------------------------------------------------------------------------------------
# Replica-model check: the same multi-turn sessions on a real replica and on its simulated model


def _check_sessions(k: int, turns: int, first: int, new: int, reply: int, seed: int) -> list[list[list[int]]]:
    """Prompts (token ids) of k sessions x `turns` turns: each turn is the previous prompt, `reply`
    ids standing in for the previous reply (the model's real reply is not echoed back, so only the
    previous prompt can be a cache hit, on the replica and in the simulator alike), then `new` ids."""
    rng = random.Random(seed)
    out = []
    for _ in range(k):
        prompt = [rng.randrange(3, 4096) for _ in range(first)]
        prompts = [prompt]
        for _ in range(turns - 1):
            prompt = prompt + [rng.randrange(3, 4096) for _ in range(reply + new)]
            prompts.append(prompt)
        out.append(prompts)
    return out


async def _check_real(url: str, sessions: list[list[list[int]]], reply: int) -> list[dict[str, float]]:
    import httpx

    rows: list[dict[str, float]] = []
    t_start = time.monotonic()

    async def session(i: int, prompts: list[list[int]], client: Any) -> None:
        for turn, prompt in enumerate(prompts):
            body = {"prompt": prompt, "max_tokens": reply, "stream": True, "temperature": 0.0, "ignore_eos": True}
            t0 = time.monotonic()
            first = None
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                r.raise_for_status()
                async for line in r.aiter_lines():
                    if first is None and line.startswith("data: ") and line != "data: [DONE]":
                        first = time.monotonic()
            rows.append({"session": i, "turn": turn, "n_prompt": len(prompt), "ttft": first - t0,
                         "e2e": time.monotonic() - t0, "end": time.monotonic() - t_start})

    async with httpx.AsyncClient(timeout=3600) as client:
        await asyncio.gather(*(session(i, p, client) for i, p in enumerate(sessions)))
    return rows


def _check_sim(sessions: list[list[list[int]]], reply: int, cal: dict[str, float]) -> list[dict[str, float]]:
    model = sim_model(16, cal)  # the engine's own block size
    sim = Simulator(EndpointPicker(parse_config({"router": {"block_size": 16}}), seed=0), {"r0": model}, "round-robin")
    rows: list[dict[str, float]] = []

    def send(i: int, turn: int) -> None:
        prompt = sessions[i][turn]

        def done(r: Any) -> None:
            rows.append({"session": i, "turn": turn, "n_prompt": len(prompt), "ttft": r.ttft,
                         "e2e": r.finish - r.arrival, "end": r.finish})
            if turn + 1 < len(sessions[i]):
                send(i, turn + 1)

        sim.submit(SimRequest(len(rows) + 1000 * i, block_hashes(prompt, 16), len(prompt), reply, sim.now,
                              f"s{i}", on_done=done))

    for i in range(len(sessions)):
        sim.at(0.0, lambda i=i: send(i, 0))
    sim.run()
    return rows


def check_replica(url: str, cal: dict[str, float], k: int, turns: int, seed: int | None = None) -> dict[str, Any]:
    """k concurrent sessions of `turns` turns (3,000-token first prompt, +1,500 new and a 425-token
    reply stand-in per turn, 425 output tokens, no think time) on the real replica at `url` and on
    the simulated replica `cal`: per-turn TTFT and end-to-end latency side by side. The content is
    new on every call (seed None), so nothing an earlier check left in the replica's cache helps."""
    seed = secrets.randbits(31) if seed is None else seed
    sessions = _check_sessions(k, turns, first=3000, new=1500, reply=425, seed=seed)
    real = asyncio.run(_check_real(url, sessions, 425))
    sim = _check_sim(sessions, 425, cal)
    key = {(r["session"], r["turn"]): r for r in sim}
    pairs = [(r, key[(r["session"], r["turn"])]) for r in real]
    lines = ["| session | turn | prompt tokens | TTFT real (s) | TTFT sim (s) | E2E real (s) | E2E sim (s) |",
             "|---|---|---|---|---|---|---|"]
    for r, m in sorted(pairs, key=lambda p: (p[0]["session"], p[0]["turn"])):
        lines.append(f"| {r['session']} | {r['turn']} | {r['n_prompt']:,} | {r['ttft']:.2f} | {m['ttft']:.2f} | "
                     f"{r['e2e']:.2f} | {m['e2e']:.2f} |")
    tot = {w: {m: sum(x[m] for x in rows) for m in ("ttft", "e2e")} | {"makespan": max(x["end"] for x in rows)}
           for w, rows in (("real", real), ("sim", sim))}
    lines.append(f"| all | | | {tot['real']['ttft']:.1f} | {tot['sim']['ttft']:.1f} | {tot['real']['e2e']:.1f} | "
                 f"{tot['sim']['e2e']:.1f} |")
    return {"sessions": k, "turns": turns, "seed": seed, "real": real, "sim": sim, "totals": tot, "table": "\n".join(lines)}


# ---------------------------------------------------------------------------------------------
# Report


def plots(rows: list[dict[str, Any]], prefix: str) -> list[str]:
    """Per workload: throughput and mean TTFT vs concurrency, and TTFT CDFs at each level where
    more than one arm ran. Agentic plots are route-{prefix}-*.png, shared-prefix ones
    route-{prefix}-shared-prefix-*.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    made = []
    for workload in ("agentic", "shared-prefix"):
        wrows = [r for r in rows if r.get("workload", "agentic") == workload and "arm" in r]
        if not wrows:
            continue
        name = prefix if workload == "agentic" else f"{prefix}-{workload}"
        unit = "concurrent sessions" if workload == "agentic" else "concurrent clients"
        levels = sorted({r["concurrency"] for r in wrows})
        fig, ax = plt.subplots(1, 2, figsize=(11, 4))
        for arm in SIM_ARMS:
            xs, tp, tt = [], [], []
            for c in levels:
                sel = [r for r in wrows if r["arm"] == arm and r["concurrency"] == c]
                if sel:
                    xs.append(c)
                    tp.append(statistics.fmean(r["total_tps"] for r in sel))
                    tt.append(statistics.fmean(r["ttft_mean"] for r in sel))
            if xs:
                ax[0].plot(xs, tp, marker="o", label=arm)
                ax[1].plot(xs, tt, marker="o", label=arm)
        ax[0].set(xlabel=unit, ylabel="total tokens/s", title=f"{name}: throughput vs concurrency")
        ax[1].set(xlabel=unit, ylabel="mean TTFT (s)", yscale="log", title=f"{name}: mean TTFT")
        ax[0].legend()
        fig.tight_layout()
        p = OUT / f"route-{name}-throughput.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p.name)
        cdf_levels = [c for c in levels if len({r["arm"] for r in wrows if r["concurrency"] == c}) > 1] or levels
        fig, axs = plt.subplots(1, len(cdf_levels), figsize=(4 * len(cdf_levels), 3.6), squeeze=False)
        for ax1, c in zip(axs[0], cdf_levels, strict=True):
            for arm in SIM_ARMS:
                t = sorted(x for r in wrows if r["arm"] == arm and r["concurrency"] == c for x in r["ttfts"])
                if t:
                    ax1.plot(t, [(i + 1) / len(t) for i in range(len(t))], label=arm)
            ax1.set(xscale="log", xlabel="TTFT (s)", ylabel="CDF", title=f"{name}: {c} {unit.split()[1]}")
        axs[0][0].legend(fontsize=7)
        fig.tight_layout()
        p = OUT / f"route-{name}-ttft-cdf.png"
        fig.savefig(p, dpi=110)
        plt.close(fig)
        made.append(p.name)
    return made


def table(rows: list[dict[str, Any]]) -> str:
    keys = sorted({(r.get("workload", "agentic"), r["concurrency"], r["arm"]) for r in rows if "arm" in r},
                  key=lambda k: (k[0], k[1], SIM_ARMS.index(k[2])))
    lines = ["| workload | sessions | arm | seeds | TTFT mean (s) | P50 | P90 | TPOT (ms) | total tok/s | output tok/s | "
             "prefix hit | decision P50 (us) |", "|" + "---|" * 12]
    for w, c, arm in keys:
        sel = [r for r in rows if r.get("workload", "agentic") == w and r["concurrency"] == c and r["arm"] == arm]

        def m(k: str, sel: list[dict[str, Any]] = sel) -> float:
            return statistics.fmean(r[k] for r in sel if k in r) if any(k in r for r in sel) else math.nan
        lines.append(f"| {w} | {c} | {arm} | {len(sel)} | {m('ttft_mean'):.3f} | {m('ttft_p50'):.3f} | "
                     f"{m('ttft_p90'):.3f} | {m('tpot_mean') * 1e3:.0f} | {m('total_tps'):,.0f} | {m('output_tps'):,.0f} | "
                     f"{m('prefix_hit_ratio'):.2f} | {m('decision_p50_us'):.0f} |")
    return "\n".join(lines)


def versus_rr(rows: list[dict[str, Any]]) -> str:
    """Mean TTFT (and P50) reduction and total-throughput ratio of each arm against round-robin,
    per (workload, sessions), seeds averaged first."""
    lines = ["| workload | sessions | arm | mean TTFT vs RR | P50 TTFT vs RR | total tok/s vs RR |", "|---|---|---|---|---|---|"]
    keys = sorted({(r.get("workload", "agentic"), r["concurrency"]) for r in rows if "arm" in r})
    for w, c in keys:
        def m(arm: str, k: str, w: str = w, c: int = c) -> float:
            sel = [r[k] for r in rows if r.get("workload", "agentic") == w and r["concurrency"] == c
                   and r.get("arm") == arm]
            return statistics.fmean(sel) if sel else math.nan
        for arm in SIM_ARMS[1:]:
            if math.isnan(m(arm, "ttft_mean")) or math.isnan(m("round-robin", "ttft_mean")):
                continue
            lines.append(f"| {w} | {c} | {arm} | {100 * (m(arm, 'ttft_mean') / m('round-robin', 'ttft_mean') - 1):+.0f}% | "
                         f"{100 * (m(arm, 'ttft_p50') / m('round-robin', 'ttft_p50') - 1):+.0f}% | "
                         f"{m(arm, 'total_tps') / m('round-robin', 'total_tps'):.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-sim", action="store_true")
    ap.add_argument("--sim-replicas", type=int, default=1000)
    ap.add_argument("--sim-per-replica", type=float, nargs="+", default=[],
                    help="agentic concurrency sweep, in sessions per replica (one seed, --sweep-arms)")
    ap.add_argument("--sweep-arms", nargs="+", default=ARMS)
    ap.add_argument("--arms", nargs="+", default=ARMS,
                    help=f"arms run at the saturation point; {DEDICATED!r} adds the bound (a replica per session)")
    ap.add_argument("--sat-per-replica", type=float, default=10,
                    help="round-robin's saturation point in sessions per replica: all arms, all seeds")
    ap.add_argument("--sp-per-replica", type=float, nargs="+", default=[],
                    help="shared-prefix concurrency sweep, in clients per replica (one seed, --sweep-arms)")
    ap.add_argument("--sp-sat-per-replica", type=float, default=6,
                    help="shared-prefix: round-robin's saturation point in clients per replica")
    ap.add_argument("--sp-duration", type=float, default=60.0, help="simulated seconds (shared-prefix)")
    ap.add_argument("--sp-warmup", type=float, default=20.0, help="of which warm-up (shared-prefix)")
    ap.add_argument("--sp-kv-tokens", type=int, default=SHARED_PREFIX_KV_TOKENS,
                    help="KV capacity per replica (shared-prefix)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--sim-duration", type=float, default=300.0, help="simulated seconds (agentic)")
    ap.add_argument("--sim-warmup", type=float, default=150.0, help="of which warm-up (agentic)")
    ap.add_argument("--sim-block", type=int, default=128,
                    help="block size in the simulator (coarser than the engine's 16 to keep 1,000 replicas fast)")
    ap.add_argument("--kv-tokens", type=int, default=AGENTIC_KV_TOKENS, help="KV capacity per replica (agentic)")
    ap.add_argument("--scrape-interval", type=float, default=1.0,
                    help="seconds between the simulated router's metric scrapes (the router's default)")
    ap.add_argument("--system-tokens", type=int, default=AgenticWorkload.system_tokens)
    ap.add_argument("--session-tokens", type=int, default=AgenticWorkload.session_tokens)
    ap.add_argument("--input-tokens", type=int, default=AgenticWorkload.tool_tokens)
    ap.add_argument("--output-tokens", type=int, default=AgenticWorkload.output_tokens)
    ap.add_argument("--tool-latency-mean", type=float, default=AgenticWorkload.tool_latency_mean_s)
    ap.add_argument("--workloads", nargs="+", default=["agentic", "shared-prefix"])
    ap.add_argument("--calibrate", metavar="URL", help="measure a running replica instead of using CALIBRATED")
    ap.add_argument("--calibrate-context-words", type=int, nargs="*", default=[],
                    help="with --calibrate: also measure prompts of these many words to fit attention's cost")
    ap.add_argument("--flat-attention", action="store_true",
                    help="replica without attention's growth with context (the flat model of earlier runs)")
    ap.add_argument("--check-replica", metavar="URL",
                    help="run multi-turn sessions on the replica at URL and on its simulated model, side by side")
    ap.add_argument("--check-sessions", type=int, nargs="+", default=[1, 4], help="concurrent sessions per check")
    ap.add_argument("--check-turns", type=int, default=6)
    ap.add_argument("--real", type=int, default=0, metavar="N", help="also bench N real engine replicas")
    ap.add_argument("--model", help="model dir for the real engines (default: the engine's bundled model)")
    ap.add_argument("--real-concurrency", type=int, nargs="+", default=[8, 24])
    ap.add_argument("--real-seeds", type=int, default=1)
    ap.add_argument("--real-duration", type=float, default=40.0)
    ap.add_argument("--real-warmup", type=float, default=8.0)
    ap.add_argument("--real-output-tokens", type=int, default=24)
    ap.add_argument("--tag", default="", help="suffix for the output files")
    ap.add_argument("--raw-dir", type=Path, default=RAW, help="where the raw per-request JSON goes (not the repo)")
    args = ap.parse_args(argv)

    cal = dict(CALIBRATED)
    if args.calibrate:
        from dataclasses import asdict

        from torchbridge.route.calibrate import calibrate

        measured = calibrate(args.calibrate, max_batch=int(cal["max_batch"]),
                             context_words=tuple(args.calibrate_context_words)).model
        cal.update({k: v for k, v in asdict(measured).items() if v is not None})
        print("calibrated:", cal)
        if args.no_sim and not args.real and not args.check_replica:
            return 0
    if args.flat_attention:
        cal.update(prefill_attn_s=0.0, decode_attn_s=0.0)
    results: dict[str, Any] = {"calibration": cal, "argv": sys.argv[1:]}
    OUT.mkdir(parents=True, exist_ok=True)
    if args.check_replica:
        results["check"] = [check_replica(args.check_replica, cal, k, args.check_turns) for k in args.check_sessions]
        for c in results["check"]:
            print(f"{c['sessions']} concurrent sessions x {c['turns']} turns:\n{c['table']}")
        path = OUT / f"route-check-replica{args.tag}.json"
        path.write_text(json.dumps(results, indent=1))
        print(f"wrote {path}")
        return 0
    if not args.no_sim:
        results["sim"] = run_sim(args, cal)
        print(table(results["sim"]))
        print(versus_rr(results["sim"]))
        results["sim_plots"] = plots(results["sim"], f"sim{args.tag}")
    if args.real:
        results["real"] = run_real(args)
        real_rows = [r for r in results["real"] if "arm" in r]
        print(table(real_rows))
        print(versus_rr(real_rows))
        results["real_plots"] = plots(real_rows, f"real{args.tag}")
    mode = ("sim" if not args.no_sim else "") + ("real" if args.real else "")
    args.raw_dir.mkdir(parents=True, exist_ok=True)
    path = args.raw_dir / f"route-results-{mode}{args.tag}.json"
    path.write_text(json.dumps(results, indent=1))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
