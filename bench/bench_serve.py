"""Benchmark the engine against Hugging Face `generate()` on the same requests, in the same run.

A ~21M-parameter random-init Llama (hidden 512, 4 layers, vocab 8000) is saved to a temporary directory.
Like vLLM's `benchmark_throughput.py` random dataset, every request has a random prompt (token ids,
--input-len MIN MAX) and its own output length (--output-len MIN MAX, uniform, fixed by the seed); EOS is
ignored so that every request produces exactly its length.

Offline throughput (requested output tokens / wall time):
  ours            LLM.generate over all requests, continuous batching (max_num_seqs = concurrency); each
                  request stops at its own length and its slot goes to a waiting request
  hf-batched      vLLM's `run_hf` baseline: static batches of `concurrency` requests in arrival order,
                  left-padded, each generate() running to the longest output of its batch (rows that
                  reached their own length keep occupying the batch; their extra tokens are not counted)
  hf-sequential   model.generate one request at a time with its own length (what a naive HF server does)
A second, smaller table repeats ours vs hf-batched with one output length for every request
(--fixed-output-len), the best case for static batches.
Online latency (like `vllm bench serve`): all requests are sent at once (up to --concurrency in
flight) as streaming /v1/completions to a real server in a subprocess; TTFT, TPOT, ITL and E2E
(mean / median / p99). For Hugging Face the same numbers come from the offline runs, timed per
token with a streamer, as if a server had run them: the sequential one serves requests FIFO (later
requests wait), the batched one serves each batch at once and ends each request's stream at its own
length.

    python bench/bench_serve.py                       # the default run (about 4 minutes on 2 cores)
    python bench/bench_serve.py --write docs/benchmarks/serve.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

BENCH_VOCAB = 8000


def make_model(out_dir: Path) -> int:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=BENCH_VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=1024,
                      bos_token_id=0, eos_token_id=1, pad_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir, BENCH_VOCAB)
    return sum(p.numel() for p in model.parameters())


def save_tokenizer(out_dir: Path, vocab: int) -> None:
    """The bundled model's tokenizer (byte-level BPE, 4,096 tokens; <|bos|>, <|eos|>, <|pad|> are ids 0-2
    as in the bench config), filled up to `vocab` with plain added tokens, so that every id the random
    model emits has a text: both engines detokenize their outputs (a server streams text)."""
    from transformers import AutoTokenizer

    from torchbridge.serve import default_model_dir

    tok = AutoTokenizer.from_pretrained(str(default_model_dir()))
    tok.add_tokens([f"<|x{i}|>" for i in range(vocab - len(tok))])
    assert len(tok) == vocab
    tok.save_pretrained(out_dir)


def make_requests(n: int, input_len: list[int], output_len: list[int], seed: int = 0,
                  vocab: int = BENCH_VOCAB) -> tuple[list[list[int]], list[int]]:
    """Prompts with uniform random lengths in input_len, and an output length per request uniform in
    output_len (both ranges inclusive)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(input_len[0], input_len[1] + 1, (n,), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]
    outs = torch.randint(output_len[0], output_len[1] + 1, (n,), generator=g).tolist()
    return prompts, outs


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


def ttft_waves(per_request: list[dict], concurrency: int) -> dict:
    """TTFT median (ms) of the first `concurrency` requests sent (they arrive at once and wait on each
    other's prefill) and of the later ones (each sent when a slot frees, into a running batch). With
    num_requests = 2 x concurrency the overall p50 falls on the boundary between the two groups and moves
    between them from run to run; these two do not."""
    by_start = sorted(per_request, key=lambda r: r["start"])
    ttft = [(r["token_times"][0] - r["start"]) * 1e3 for r in by_start]
    first, later = ttft[:concurrency], ttft[concurrency:]
    return {"first": statistics.median(first), "later": statistics.median(later) if later else float("nan")}


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


def run_hf(model_dir: Path, requests: list[list[int]], out_lens: list[int], batch: int,
           dtype: str = "float32") -> tuple[float, list[dict], int]:
    """vLLM's run_hf: batches in arrival order, left-padded, max_new_tokens = the batch's longest output
    (min_new_tokens the same, so EOS cannot end it early). Returns (seconds, per-request token times,
    tokens generated including those past a request's own length)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        model.generate(torch.tensor([requests[0][:8]]), max_new_tokens=2, do_sample=False, pad_token_id=2)
    per_request, computed = [], 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(requests), batch):
            chunk, lens = requests[i : i + batch], out_lens[i : i + batch]
            n = max(lens)
            width = max(len(p) for p in chunk)
            ids = torch.full((len(chunk), width), 2, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for j, p in enumerate(chunk):  # left padding, as generate() wants for decoder-only models
                ids[j, width - len(p) :] = torch.tensor(p)
                mask[j, width - len(p) :] = 1
            clock = _Clock()
            out = model.generate(ids, attention_mask=mask, streamer=clock, do_sample=False, max_new_tokens=n,
                                 min_new_tokens=n, pad_token_id=2)
            assert out.shape[1] - width == n
            computed += n * len(chunk)
            # A server would end each request's stream at its own length (the batch runs on).
            per_request += [{"start": t0, "token_times": clock.times[:k], "num_tokens": k} for k in lens]
    return time.perf_counter() - t0, per_request, computed


# ---- ours -----------------------------------------------------------------------------------------
def run_ours_offline(model_dir: Path, requests: list[list[int]], out_lens: list[int], concurrency: int,
                     decode_workspace: bool = True, device: str = "cpu", compile_model: bool | None = None,
                     dtype: str = "float32", async_scheduling: bool | None = None) -> float:
    from torchbridge.serve import LLM, SamplingParams

    extra = {} if device == "cpu" else {"device": device, "compile_model": compile_model,
                                        "async_scheduling": async_scheduling}
    llm = LLM(str(model_dir), max_num_seqs=concurrency, max_model_len=1024, enable_prefix_caching=False,
              decode_workspace=decode_workspace, dtype=dtype, **extra)
    llm.generate([requests[0][:8]], SamplingParams(temperature=0, max_tokens=2))
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    if device != "cpu":
        # Steady state, as a server reaches after start-up: one untimed pass compiles every shape
        # bucket this workload meets (a compiled step, or op-by-op programs); none are compiled later.
        llm.generate(requests, params)
    t0 = time.perf_counter()
    outs = llm.generate(requests, params)
    dt = time.perf_counter() - t0
    assert [len(o.outputs[0].token_ids) for o in outs] == out_lens
    return dt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _online_client(base: str, requests: list[list[int]], out_lens: list[int], concurrency: int) -> list[dict]:
    import httpx

    sem = asyncio.Semaphore(concurrency)
    results: list[dict] = []

    async def one(client: httpx.AsyncClient, prompt: list[int], output_len: int) -> None:
        body = {"model": "bench", "prompt": prompt, "max_tokens": output_len, "temperature": 0, "stream": True,
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        async with sem:
            # timed from the send, as `vllm bench serve` times it: not the wait for a concurrency slot
            start = time.perf_counter()
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
        await asyncio.gather(*(one(client, p, n) for p, n in zip(requests, out_lens, strict=True)))
    return results


def engine_iterations(base: str) -> tuple[float, float]:
    """(engine steps, tokens they processed) so far, from the server's vLLM-named histogram
    vllm:iteration_tokens_total (both engines export it); (nan, nan) where it is missing."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    names = ("vllm:iteration_tokens_total_count", "vllm:iteration_tokens_total_sum")
    found: dict[str, float] = {}
    for fam in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=10).text):
        for sample in fam.samples:
            if sample.name in names:  # summed over label sets (an engine per data-parallel rank)
                found[sample.name] = found.get(sample.name, 0.0) + sample.value
    return found.get(names[0], math.nan), found.get(names[1], math.nan)


def wait_healthy(proc: subprocess.Popen, base: str, deadline: float, log: Any, cmd: list[str]) -> None:
    """Return once `base`/health answers 200; raise with the server's log (`log`, a file) when `proc`
    exits or time.monotonic() passes `deadline`. One client, polled every 0.2 s: a new client per poll
    took ~28% of a core from the server starting beside it."""
    import httpx

    with httpx.Client(timeout=1) as client:
        while True:
            try:
                if client.get(base + "/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"server did not start: {' '.join(cmd)}\n" + log.read().decode()[-5000:])
            time.sleep(0.2)


def run_online(cmd: list[str], env: dict[str, str], requests: list[list[int]], out_lens: list[int],
               concurrency: int, start_timeout: float = 120) -> tuple[float, list[dict], float, dict[str, float]]:
    """Start a server (`cmd`, which listens on the port after its --port), wait for /health, warm it up
    with two short requests, then time the workload. Returns (wall s, per-request times, start-up s, the
    workload's engine steps and tokens per step from /metrics)."""

    port = cmd[cmd.index("--port") + 1]
    base = f"http://127.0.0.1:{port}"
    # stderr to a file, not a pipe: a chatty server would block on a full pipe.
    with tempfile.TemporaryFile() as log:
        t_start = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env)
        try:
            wait_healthy(proc, base, t_start + start_timeout, log, cmd)
            startup = time.monotonic() - t_start
            asyncio.run(_online_client(base, requests[:2], [2, 2], 2))  # warm the server up
            steps0, tokens0 = engine_iterations(base)
            t0 = time.perf_counter()
            results = asyncio.run(_online_client(base, requests, out_lens, concurrency))
            wall = time.perf_counter() - t0
            assert results and sum(r["num_tokens"] for r in results) == sum(out_lens)
            steps1, tokens1 = engine_iterations(base)
            steps = steps1 - steps0
            iters = {"steps": steps, "tokens_per_step": (tokens1 - tokens0) / steps if steps else float("nan")}
            return wall, results, startup, iters
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def ours_serve_command(model_dir: Path, port: int, concurrency: int, dtype: str = "float32") -> list[str]:
    code = "import sys; from torchbridge.serve.cli import main; sys.exit(main(sys.argv[1:]))"
    return [sys.executable, "-c", code, "--model", str(model_dir), "--port", str(port), "--served-model-name", "bench",
            "--max-num-seqs", str(concurrency), "--max-model-len", "1024", "--no-enable-prefix-caching",
            "--dtype", dtype, "--log-level", "warning"]


def run_ours_online(
    model_dir: Path, requests: list[list[int]], out_lens: list[int], concurrency: int, threads: int,
    dtype: str = "float32",
) -> tuple[float, list[dict]]:
    cmd = ours_serve_command(model_dir, free_port(), concurrency, dtype)
    t, results, _, _ = run_online(cmd, thread_env(threads), requests, out_lens, concurrency)
    return t, results


def ratios(results: dict[str, dict]) -> dict[str, float]:
    """Throughput of ours over each other engine's (same output tokens, so a ratio of wall times)."""
    return {k: v["seconds"] / results["ours"]["seconds"] for k, v in results.items() if k != "ours"}


def notes(results: dict[str, dict], fixed: dict[str, dict], args: argparse.Namespace, n_out: int) -> str:
    ratio = {k: r for k, r in ratios(results).items() if k.startswith("hf-")}
    target = " and ".join(f"{r:.2f}x {k}" for k, r in ratio.items())
    met = [k for k, r in ratio.items() if r >= 5]
    verdict = (
        f"The 5x target is met against {', '.join(met)}" + ("" if len(met) == len(ratio) else
                                                             f" but not against {', '.join(k for k in ratio if k not in met)}")
        if met else "The 5x target is not met"
    )
    lines = [f"- Throughput of ours relative to Hugging Face (varied output lengths): {target}. {verdict}."]
    if "hf-batched" in results:
        c = results["hf-batched"]["computed"]
        lines.append(
            f"- hf-batched generated {c} tokens to deliver {n_out} ({c / n_out:.2f}x): each static batch runs to its\n"
            "  longest request, and rows that are done keep being computed (padding after their end). Ours stops\n"
            "  each request at its own length and hands its slot to a waiting request.")
    if fixed:
        fr = ratios(fixed)["hf-batched"]
        lines.append(
            f"- With one output length for every request ({args.fixed_output_len} tokens, the best case for static\n"
            f"  batches: no row waits for a longer one) ours is {fr:.2f}x hf-batched (second table). There both\n"
            "  engines do the same useful work in the same fp32 matmuls; ours saves HF's left padding in prefill and\n"
            "  its per-step KV-cache concatenation. Real request sets have varied lengths (first table).")
    lines += [
        "- What bounds the ratio: in both engines most of a step is the same fp32 matmuls (one thread, MKL), which\n"
        "  run near the core's peak either way. Ours wins by computing fewer tokens (no padding, no rows past their\n"
        "  end) and by cheaper attention, not by faster matmuls. Since a token's matmuls cost both engines about\n"
        "  the same, the ratio to hf-batched stays near HF's extra tokens (tokens-generated column) times what\n"
        "  padding and attention add on top; 5x would need matmuls several times cheaper than HF's own.",
        "- hf-sequential is what a server that calls generate() once per request does; hf-batched is vLLM's own\n"
        "  Hugging Face baseline (`run_hf` in benchmark_throughput.py): static batches in arrival order, left\n"
        "  padding, max_new_tokens = the batch's longest output. Requests are not sorted by output length (a\n"
        "  server does not know it in advance). HF ran fp32 with its default (sdpa) attention and DynamicCache, the\n"
        "  same thread count, and min_new_tokens = max_new_tokens so that EOS cannot end a batch early.",
        "- Ours ran with prefix caching off (random prompts share nothing), fp32, block size 16, 1024-token step\n"
        "  budget. `ours` keeps each decoding sequence's K/V contiguous (the decode workspace in\n"
        "  src/torchbridge/serve/attention.py); `ours-gather` is the same engine with `decode_workspace=False`,\n"
        "  which gathers every sequence's K/V out of the paged cache in every layer of every step (the engine\n"
        f"  before this change): the workspace is worth {ratios(results).get('ours-gather', float('nan')):.2f}x here.",
        "- The machine is a shared 2-core VM with other jobs running: absolute numbers are noisy, and ratios move\n"
        f"  between invocations by tens of percent. Each offline arm runs {args.repeats} time(s) and the fastest run\n"
        "  counts (hf-sequential once; the last column lists every run). Each measured workload runs in its own fresh process with the same torch thread count\n"
        "  (`--threads`, default 1): with 2 OpenMP threads on the oversubscribed machine, every parallel op waits\n"
        "  for a descheduled thread, which made both engines several times slower and the numbers erratic.",
        "- Online latency for ours is measured over HTTP (streaming /v1/completions against the server in a\n"
        "  subprocess); for HF it is derived from the offline runs, each token timed by a streamer, with no HTTP or\n"
        "  queueing code: hf-sequential as a FIFO server that runs one request at a time, hf-batched as one that\n"
        "  runs each batch at once and ends each stream at the request's own length. This favours HF slightly.",
    ]
    if "ours-tpu" in results:
        tpu = results["ours-tpu"]["seconds"]
        lines.append(
            f"- `ours-tpu` is the same engine on the bridge's device (XLA on this CPU), its default there: each shape\n"
            f"  bucket's whole step compiled as one graph (torch.compile(backend=\"tpu\")). Steady state: one untimed\n"
            f"  pass of the same requests compiles every bucket they meet, then the timed pass compiles nothing.\n"
            f"  {n_out / tpu:.1f} tok/s, {tpu / results['ours']['seconds']:.1f}x the time of `ours` on `cpu`.")
    if "ours-tpu-ops" in results:
        ops_s = results["ours-tpu-ops"]["seconds"]
        lines.append(
            f"- `ours-tpu-ops` is the bridge device with `compile_model=False`: every op of a step runs as its own\n"
            f"  cached XLA program (eager mode), {n_out / ops_s:.1f} tok/s, same steady-state protocol.")
    return "\n".join(lines)


def thread_env(threads: int) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def in_subprocess(kind: str, model_dir: Path, args: argparse.Namespace, output_len: list[int],
                  num_requests: int) -> dict:
    """Run one measured workload in a fresh interpreter (the server is a subprocess too), so that no
    engine inherits the parent's heap and threads."""
    cmd = [sys.executable, __file__, "--worker", kind, "--model-dir", str(model_dir),
           "--num-requests", str(num_requests), "--concurrency", str(args.concurrency), "--seed", str(args.seed),
           "--input-len", *map(str, args.input_len), "--output-len", *map(str, output_len), "--threads", str(args.threads),
           "--dtype", args.dtype, "--vocab", str(args.vocab)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=thread_env(args.threads))
    return json.loads(out.stdout.strip().splitlines()[-1])


def best_of(repeats: int, kind: str, model_dir: Path, args: argparse.Namespace, output_len: list[int],
            num_requests: int) -> dict:
    """The fastest of `repeats` fresh-process runs (the machine is shared: slow runs are interference)."""
    runs = [in_subprocess(kind, model_dir, args, output_len, num_requests) for _ in range(repeats)]
    best = min(runs, key=lambda r: r["seconds"])
    best["all_seconds"] = [round(r["seconds"], 2) for r in runs]
    return best


def worker(kind: str, model_dir: Path, args: argparse.Namespace) -> int:
    reqs, out_lens = make_requests(args.num_requests, args.input_len, args.output_len, args.seed, args.vocab)
    torch.set_num_threads(args.threads)
    result: dict = {}
    if kind in ("ours", "ours-gather", "ours-untiled", "ours-unpaneled"):
        if kind == "ours-untiled":  # bf16 decode rows through oneDNN, not the AMX / AVX512-BF16 tile kernel
            os.environ["TORCHBRIDGE_SERVE_TILES"] = "0"
        if kind == "ours-unpaneled":  # float32 linears through oneDNN's packed GEMM, not the panel kernel
            os.environ["TORCHBRIDGE_SERVE_PANELS"] = "0"
        result["seconds"] = run_ours_offline(model_dir, reqs, out_lens, args.concurrency, kind != "ours-gather",
                                             dtype=args.dtype)
    elif kind in ("ours-tpu", "ours-tpu-ops", "ours-tpu-unheld", "ours-tpu-sync", "ours-tpu-padded", "ours-tpu-untiled",
                  "ours-tpu-threads"):
        import torchbridge

        if kind == "ours-tpu-threads":  # XLA's CPU pools of --threads threads each (its default: one per CPU)
            os.environ["TORCHBRIDGE_XLA_CPU_THREADS"] = str(args.threads)
        if kind == "ours-tpu-untiled":  # held bf16 weights without the tile kernel: oneDNN from 4 rows, XLA below
            os.environ["TORCHBRIDGE_SERVE_TILES"] = "0"
        if kind == "ours-tpu-padded":  # fresh prompts padded into the masked group, not packed per span
            os.environ["TORCHBRIDGE_SERVE_FRESH_PREFILL"] = "0"

        if kind == "ours-tpu-unheld":  # every product in XLA, none through held weights (oneDNN 16-bit or panels)
            os.environ["TORCHBRIDGE_SERVE_HELD"] = "0"

        result["seconds"] = run_ours_offline(model_dir, reqs, out_lens, args.concurrency,
                                             device=torchbridge.device_name(), compile_model=kind != "ours-tpu-ops",
                                             dtype=args.dtype,
                                             # (ours-tpu-sync: each step waits for its program before the next is scheduled)
                                             async_scheduling=False if kind == "ours-tpu-sync" else None)
    else:
        batch = args.concurrency if kind == "hf-batched" else 1
        t, per, computed = run_hf(model_dir, reqs, out_lens, batch, args.dtype)
        result.update(seconds=t, online=summarize(per), computed=computed)
    print(json.dumps(result))
    return 0


def throughput_table(results: dict[str, dict], n_out: int) -> list[str]:
    ours = results["ours"]["seconds"]
    lines = ["| engine | wall s (best) | output tok/s | ours / engine | tokens generated | wall s of each run |",
             "|---|---:|---:|---:|---:|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['seconds']:.2f} | {n_out / r['seconds']:.1f} | {r['seconds'] / ours:.2f}x "
                     f"| {r.get('computed', n_out)} | {', '.join(map(str, r['all_seconds']))} |")
    return lines


ARMS = ("ours", "ours-thread", "ours-gather", "ours-untiled", "ours-unpaneled", "ours-tpu", "ours-tpu-ops", "ours-tpu-unheld", "ours-tpu-sync",
        "ours-tpu-padded", "ours-tpu-untiled", "ours-tpu-threads", "hf-batched", "hf-sequential", "vllm")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--input-len", type=int, nargs=2, default=[32, 128], metavar=("MIN", "MAX"))
    ap.add_argument("--output-len", type=int, nargs=2, default=[16, 128], metavar=("MIN", "MAX"),
                    help="each request's output length is uniform in [MIN, MAX] (MIN = MAX: all equal)")
    ap.add_argument("--fixed-output-len", type=int, default=48,
                    help="also compare ours and hf-batched with this one output length for all requests "
                         "(one batch of --concurrency requests); 0 skips it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=2,
                    help="offline runs per arm, each in a fresh process; the fastest counts (hf-sequential: one run)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of every engine (1: the shared machine is oversubscribed, and 2-thread "
                         "OpenMP steps stall there whenever the other thread is descheduled)")
    ap.add_argument("--no-hf-sequential", action="store_true", help="skip the slow one-request-at-a-time baseline")
    ap.add_argument("--no-device", action="store_true", help="skip the engine on the bridge's device (ours-tpu)")
    ap.add_argument("--write", type=Path, default=None, help="write the markdown report here")
    ap.add_argument("--arms", default=None,
                    help=f"comma-separated engines to compare, arms alternated per round (e.g. ours,vllm); one of "
                         f"{','.join(ARMS)}. Without it: the fixed set of the original report")
    ap.add_argument("--rounds", type=int, default=3, help="with --arms: rounds (medians and ranges over them)")
    ap.add_argument("--model", default="bench",
                    help="with --arms: 'bench' (the 21M random Llama), 'bundled' (the bundled model) or a checkpoint dir")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                    help="every engine's dtype")
    ap.add_argument("--no-online", action="store_true", help="with --arms: skip the servers (TTFT, TPOT, ITL, E2E)")
    ap.add_argument("--no-offline", action="store_true", help="with --arms: skip LLM.generate (servers only)")
    ap.add_argument("--vocab", type=int, default=BENCH_VOCAB, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args.worker, args.model_dir, args)
    if args.arms:
        from bench_serve_versus import versus

        return versus(args, argv if argv is not None else sys.argv[1:])

    reqs, out_lens = make_requests(args.num_requests, args.input_len, args.output_len, args.seed)
    n_out = sum(out_lens)
    fixed: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "bench-llama"
        params = make_model(model_dir)
        print(f"model: {params / 1e6:.1f}M parameters; {args.num_requests} requests, prompts "
              f"{args.input_len[0]}-{args.input_len[1]} tokens, outputs {args.output_len[0]}-{args.output_len[1]} "
              f"tokens ({n_out} in all)", flush=True)
        results: dict[str, dict] = {}
        results["ours"] = best_of(args.repeats, "ours", model_dir, args, args.output_len, args.num_requests)
        print(f"ours offline: {n_out / results['ours']['seconds']:.1f} tok/s", flush=True)
        t, online = run_ours_online(model_dir, reqs, out_lens, args.concurrency, args.threads)
        results["ours"]["online"] = summarize(online)
        results["ours"]["online_seconds"] = t
        print(f"ours online: {json.dumps(results['ours']['online'])}", flush=True)
        arms = ("ours-gather", "hf-batched") + (() if args.no_hf_sequential else ("hf-sequential",))
        arms += () if args.no_device else ("ours-tpu", "ours-tpu-ops")
        for kind in arms:
            repeats = 1 if kind in ("hf-sequential", "ours-tpu", "ours-tpu-ops") else args.repeats
            results[kind] = best_of(repeats, kind, model_dir, args, args.output_len, args.num_requests)
            print(f"{kind}: {n_out / results[kind]['seconds']:.1f} tok/s", flush=True)
        if args.fixed_output_len:
            n = args.fixed_output_len
            for kind in ("ours", "hf-batched"):
                fixed[kind] = best_of(args.repeats, kind, model_dir, args, [n, n], args.concurrency)
                print(f"{kind}, {n} output tokens each: {args.concurrency * n / fixed[kind]['seconds']:.1f} tok/s",
                      flush=True)

    lines = throughput_table(results, n_out)
    fixed_lines = throughput_table(fixed, args.concurrency * args.fixed_output_len) if fixed else []
    lat = ["| engine | metric | mean ms | median ms | p99 ms |", "|---|---|---:|---:|---:|"]
    for name, r in results.items():
        for metric, v in r.get("online", {}).items():
            lat.append(f"| {name} | {metric.upper()} | {v['mean']:.1f} | {v['median']:.1f} | {v['p99']:.1f} |")
    report = "\n".join(lines) + "\n\n" + ("\n".join(fixed_lines) + "\n\n" if fixed else "") + "\n".join(lat) + "\n"
    print(report)
    print(notes(results, fixed, args, n_out))
    if args.write:
        cmd = "python bench/bench_serve.py " + " ".join(argv if argv is not None else sys.argv[1:])
        env = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs (shared with other jobs), "
               f"torch {torch.__version__}, {args.threads} torch thread(s) per engine")
        fixed_md = ""
        if fixed:
            fixed_md = (f"### Equal output lengths ({args.concurrency} requests, {args.fixed_output_len} output tokens "
                        f"each: HF's best case)\n\n{chr(10).join(fixed_lines)}\n\n")
        args.write.parent.mkdir(parents=True, exist_ok=True)
        args.write.write_text(
            f"# Engine benchmark\n\nCommand: `{cmd.strip()}`\n\nMachine: {env}.\n\n"
            f"Workload (seed {args.seed}): {args.num_requests} requests, prompts uniform in "
            f"{args.input_len[0]}-{args.input_len[1]} tokens, output lengths uniform in "
            f"{args.output_len[0]}-{args.output_len[1]} tokens ({n_out} output tokens in all, EOS ignored), "
            f"concurrency {args.concurrency}.\n\n"
            f"## Offline throughput\n\n{chr(10).join(lines)}\n\n{fixed_md}"
            f"## Online latency\n\n{chr(10).join(lat)}\n\n"
            f"## Notes\n\n{notes(results, fixed, args, n_out)}\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
