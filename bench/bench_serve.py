"""Benchmark the engine against Hugging Face `generate()` on the same requests, in the same run.

A ~21M-parameter random-init Llama (hidden 512, 4 layers, vocab 8000) is saved to a temporary directory.
Every request has a random prompt (token ids) and asks for exactly --output-len tokens (EOS ignored).

Offline throughput (generated tokens / wall time):
  ours            LLM.generate over all requests, continuous batching (max_num_seqs = concurrency)
  hf-batched      model.generate on static batches of `concurrency` left-padded prompts
  hf-sequential   model.generate one request at a time (what a naive HF server does)
Online latency (like `vllm bench serve`): all requests are sent at once (up to --concurrency in
flight) as streaming /v1/completions to a real server in a subprocess; TTFT, TPOT, ITL and E2E
(mean / median / p99). For Hugging Face the same numbers come from the two offline runs, timed per
token with a streamer, as if a server had run them: the sequential one serves requests FIFO (later
requests wait), the batched one serves each batch at once.

    python bench/bench_serve.py                       # the default run (under ~5 minutes on 2 cores)
    python bench/bench_serve.py --write docs/benchmarks/serve.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def make_model(out_dir: Path) -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def make_requests(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, 8000, (k,), generator=g).tolist() for k in lens]


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] if xs else float("nan")


def summarize(per_request: list[dict]) -> dict:
    """per_request: {"start", "token_times": [t of each token (or chunk) arrival], "num_tokens"}."""
    ttft, tpot, itl, e2e = [], [], [], []
    for r in per_request:
        times = r["token_times"]
        ttft.append(times[0] - r["start"])
        e2e.append(times[-1] - r["start"])
        if r["num_tokens"] > 1:
            tpot.append((times[-1] - times[0]) / (r["num_tokens"] - 1))
        itl.extend(b - a for a, b in zip(times, times[1:], strict=False))
    out = {}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        out[name] = {"mean": statistics.fmean(xs) * 1e3, "median": statistics.median(xs) * 1e3, "p99": pct(xs, 99) * 1e3}
    return out


# ---- Hugging Face ---------------------------------------------------------------------------------
class _Clock:
    """A generate() streamer that records when each step's tokens come out."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._first = True

    def put(self, value: torch.Tensor) -> None:
        if self._first:  # generate() first hands over the prompt
            self._first = False
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def run_hf(model_dir: Path, requests: list[list[int]], output_len: int, batch: int) -> tuple[float, list[dict]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    kw = dict(do_sample=False, max_new_tokens=output_len, min_new_tokens=output_len, pad_token_id=2)
    with torch.no_grad():
        model.generate(torch.tensor([requests[0][:8]]), max_new_tokens=2, do_sample=False, pad_token_id=2)
    per_request, generated = [], 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(requests), batch):
            chunk = requests[i : i + batch]
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), 2, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, p in enumerate(chunk):  # left padding, as generate() wants for decoder-only models
                ids[j, width - len(p) :] = torch.tensor(p)
                mask[j, width - len(p) :] = 1
            clock = _Clock()
            out = model.generate(ids, attention_mask=mask, streamer=clock, **kw)
            generated += (out.shape[1] - width) * len(chunk)
            per_request += [{"start": t0, "token_times": clock.times, "num_tokens": output_len} for _ in chunk]
    return time.perf_counter() - t0, per_request


# ---- ours -----------------------------------------------------------------------------------------
def run_ours_offline(model_dir: Path, requests: list[list[int]], output_len: int, concurrency: int) -> float:
    from torchbridge.serve import LLM, SamplingParams

    llm = LLM(str(model_dir), max_num_seqs=concurrency, max_model_len=1024, enable_prefix_caching=False)
    llm.generate([requests[0][:8]], SamplingParams(temperature=0, max_tokens=2))
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(requests, params)
    dt = time.perf_counter() - t0
    assert all(len(o.outputs[0].token_ids) == output_len for o in outs)
    return dt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _online_client(base: str, requests: list[list[int]], output_len: int, concurrency: int) -> list[dict]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = []

    async def one(client: httpx.AsyncClient, prompt: list[int], start: float) -> None:
        body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        async with sem:
            times, tokens = [], 0
            async with client.stream("POST", base + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if chunk["choices"]:
                        times.append(time.perf_counter())
                    elif chunk.get("usage"):
                        tokens = chunk["usage"]["completion_tokens"]
            results.append({"start": start, "token_times": times, "num_tokens": tokens})

    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        start = time.perf_counter()
        await asyncio.gather(*(one(client, p, start) for p in requests))
    return results


def run_ours_online(
    model_dir: Path, requests: list[list[int]], output_len: int, concurrency: int, threads: int
) -> tuple[float, list[dict]]:
    import httpx

    port = free_port()
    code = ("import sys; from torchbridge.serve.cli import main; sys.exit(main(sys.argv[1:]))")
    cmd = [sys.executable, "-c", code, "--model", str(model_dir), "--port", str(port), "--served-model-name", "bench",
           "--max-num-seqs", str(concurrency), "--max-model-len", "1024", "--no-enable-prefix-caching",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=thread_env(threads))
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server did not start: " + (proc.stderr.read().decode() if proc.stderr else ""))
            time.sleep(0.2)
        asyncio.run(_online_client(base, requests[:2], 2, 2))  # warm the server up
        t0 = time.perf_counter()
        results = asyncio.run(_online_client(base, requests, output_len, concurrency))
        return time.perf_counter() - t0, results
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def notes(results: dict, ours_tps: float, n_out: int) -> str:
    ratio = {k: ours_tps / (n_out / v["seconds"]) for k, v in results.items() if k != "ours"}
    target = " and ".join(f"{r:.2f}x {k}" for k, r in ratio.items())
    met = [k for k, r in ratio.items() if r >= 5]
    verdict = (
        f"The 5x target is met against {', '.join(met)}" + ("" if len(met) == len(ratio) else
                                                             f" but not against {', '.join(k for k in ratio if k not in met)}")
        if met else "The 5x target is not met"
    )
    return (
        f"- Throughput of ours relative to Hugging Face: {target}. {verdict}.\n"
        "- Every request has the same output length (EOS ignored), which is the best case for HF's static batches:\n"
        "  no sequence waits for a longer one. hf-batched still pays for left padding; hf-sequential is what a\n"
        "  server that calls generate() per request does.\n"
        "- Ours ran with prefix caching off (random prompts share nothing), fp32, block size 16, 1024-token step\n"
        "  budget. HF ran fp32 with its default (sdpa) attention and DynamicCache.\n"
        "- The machine is a shared 2-core VM with other jobs running: absolute numbers are noisy; the ratios come\n"
        "  from one run. Each measured workload runs in its own fresh process with the same torch thread count\n"
        "  (`--threads`, default 1): with 2 OpenMP threads on the oversubscribed machine, every parallel op waits\n"
        "  for a descheduled thread, which made both engines several times slower and the numbers erratic.\n"
        + '- Online latency for ours is measured over HTTP (streaming /v1/completions against the server in a subprocess);\n  for HF it is derived from the offline runs, each token timed by a streamer, with no HTTP or queueing\n  code: hf-sequential as a FIFO server that runs one request at a time, hf-batched as one that runs the\n  whole batch at once. This favours HF slightly.'
    )


def thread_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def in_subprocess(kind: str, model_dir: Path, args: argparse.Namespace) -> dict:
    """Run one measured workload in a fresh interpreter (the server is a subprocess too), so that no
    engine inherits the parent's heap and threads."""
    cmd = [sys.executable, __file__, "--worker", kind, "--model-dir", str(model_dir),
           "--num-requests", str(args.num_requests), "--concurrency", str(args.concurrency),
           "--input-len", *map(str, args.input_len), "--output-len", str(args.output_len), "--threads", str(args.threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=thread_env(args.threads))
    return json.loads(out.stdout.strip().splitlines()[-1])


def worker(kind: str, model_dir: Path, args: argparse.Namespace) -> int:
    reqs = make_requests(args.num_requests, *args.input_len)
    torch.set_num_threads(args.threads)
    result: dict = {}
    if kind == "ours":
        result["seconds"] = run_ours_offline(model_dir, reqs, args.output_len, args.concurrency)
    else:
        batch = args.concurrency if kind == "hf-batched" else 1
        t, per = run_hf(model_dir, reqs, args.output_len, batch)
        result.update(seconds=t, online=summarize(per))
    print(json.dumps(result))
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of every engine (1: the shared machine is oversubscribed, and 2-thread "
                         "OpenMP steps stall there whenever the other thread is descheduled)")
    ap.add_argument("--no-hf-sequential", action="store_true", help="skip the slow one-request-at-a-time baseline")
    ap.add_argument("--write", type=Path, default=None, help="write the markdown report here")
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.model_dir, args)

    reqs = make_requests(args.num_requests, *args.input_len)
    n_out = args.num_requests * args.output_len
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "bench-llama"
        params = make_model(model_dir)
        print(f"model: {params / 1e6:.1f}M parameters; {args.num_requests} requests, prompts "
              f"{args.input_len[0]}-{args.input_len[1]} tokens, {args.output_len} output tokens each", flush=True)
        results: dict[str, dict] = {}
        results["ours"] = in_subprocess("ours", model_dir, args)
        print(f"ours offline: {n_out / results['ours']['seconds']:.1f} tok/s", flush=True)
        t, online = run_ours_online(model_dir, reqs, args.output_len, args.concurrency, args.threads)
        results["ours"]["online"] = summarize(online)
        results["ours"]["online_seconds"] = t
        print(f"ours online: {json.dumps(results['ours']['online'])}", flush=True)
        for kind in ("hf-batched",) + (() if args.no_hf_sequential else ("hf-sequential",)):
            results[kind] = in_subprocess(kind, model_dir, args)
            print(f"{kind}: {n_out / results[kind]['seconds']:.1f} tok/s", flush=True)

    ours_tps = n_out / results["ours"]["seconds"]
    lines = [
        "| engine | wall s | output tok/s | ours / engine |",
        "|---|---:|---:|---:|",
    ]
    for name, r in results.items():
        tps = n_out / r["seconds"]
        lines.append(f"| {name} | {r['seconds']:.2f} | {tps:.1f} | {ours_tps / tps:.2f}x |")
    lat = ["| engine | metric | mean ms | median ms | p99 ms |", "|---|---|---:|---:|---:|"]
    for name, r in results.items():
        for metric, v in r["online"].items():
            lat.append(f"| {name} | {metric.upper()} | {v['mean']:.1f} | {v['median']:.1f} | {v['p99']:.1f} |")
    report = "\n".join(lines) + "\n\n" + "\n".join(lat) + "\n"
    print(report)
    if args.write:
        cmd = "python bench/bench_serve.py " + " ".join(argv if argv is not None else sys.argv[1:])
        env = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), "
               f"torch {torch.__version__}, {args.threads} torch thread(s) per engine")
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(
            f"# Engine benchmark\n\nCommand: `{cmd.strip()}`\n\nMachine: {env}. "
            f"{args.num_requests} requests, prompts {args.input_len[0]}-{args.input_len[1]} tokens, "
            f"{args.output_len} output tokens each, concurrency {args.concurrency}.\n\n"
            f"## Offline throughput\n\n{chr(10).join(lines)}\n\n## Online latency\n\n{chr(10).join(lat)}\n\n"
            f"## Notes\n\n{notes(results, ours_tps, n_out)}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
