"""Overhead of grammar-constrained decoding: tokens/s with and without a JSON schema, 32 concurrent.

One `torchbridge serve` of the bundled model in a subprocess; each round sends the same 32 chat
requests at once, once free and once with `response_format: json_schema` (arms alternated, the first
arm swapped every round). Every request generates exactly --max-tokens tokens: the free arm ignores
EOS, and the schema (an array of at least 1,000 short strings) cannot end within them, so both
arms do the same number of steps at the same batch size and differ only by the grammar work (mask
fill, mask apply, token accept). Tokens/s = completion tokens / wall time of the round.

    python bench/bench_serve_structured.py --rounds 5 --write
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

# The engine runs on cpu; registering the bridge device (JAX and its threads) would only compete with it.
os.environ.setdefault("TORCHBRIDGE_NO_DEVICE", "1")

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "docs" / "benchmarks" / "serve.md"
# minItems keeps the array (and the request) open past any --max-tokens used here.
SCHEMA = {"type": "object", "properties": {"names": {"type": "array", "minItems": 1000,
                                                     "items": {"type": "string", "maxLength": 6}}},
          "required": ["names"]}
SECTION = "## Structured outputs: overhead of a JSON schema"


async def _round(url: str, n: int, max_tokens: int, constrained: bool) -> tuple[int, float]:
    async with httpx.AsyncClient(timeout=600) as c:
        async def one(i: int) -> int:
            body: dict = {"model": "m", "messages": [{"role": "user", "content": f"List names, item {i}."}],
                          "max_tokens": max_tokens, "temperature": 0.8, "seed": i}
            if constrained:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "names", "schema": SCHEMA}}
            else:
                body["ignore_eos"] = True
            r = await c.post(url + "/v1/chat/completions", json=body)
            r.raise_for_status()
            return int(r.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(i) for i in range(n))))
        return tokens, time.perf_counter() - t0


def mask_cost(n: int, steps: int) -> list[float]:
    """Seconds per step of the grammar work alone (fill and apply the masks of n rows, accept one token per
    row), on n matchers of SCHEMA driven along random allowed tokens, in this fresh process."""
    import json

    import torch

    from torchbridge.serve import default_model_dir
    from torchbridge.serve.structured_output import GrammarCompiler, GuidedDecoding, TokenMasks
    from torchbridge.serve.tokenizer import Tokenizer

    tok = Tokenizer(default_model_dir())
    compiler = GrammarCompiler(tok.hf, 4096, [1, 4])
    g = compiler.compile(GuidedDecoding("json", json.dumps(SCHEMA)))
    matchers = [compiler.matcher(g) for _ in range(n)]
    masks, gen = TokenMasks(), torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        logits = torch.randn(n, 4096, generator=gen)
        t0 = time.perf_counter()
        masks.apply(logits, matchers)
        t1 = time.perf_counter()
        tokens = logits.argmax(dim=-1).tolist()  # the sampler's own work, in both arms: not timed
        t2 = time.perf_counter()
        for m, t in zip(matchers, tokens, strict=True):
            m.accept_token(t)
        out.append(t1 - t0 + time.perf_counter() - t2)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write", action="store_true", help=f"append/replace the section in {OUT.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    from torchbridge.route.supervisor import free_port, stop_all, wait_healthy

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "torchbridge", "serve", "--port", str(port), "--served-model-name",
                             "m", "--max-num-seqs", str(args.concurrency), "--log-level", "warning"],
                            env={**os.environ, "TORCHBRIDGE_NO_DEVICE": "1"})
    url = f"http://127.0.0.1:{port}"
    rows: list[tuple[str, int, float, float]] = []
    try:
        if not wait_healthy(url, proc, 300):
            raise RuntimeError("server did not start")
        asyncio.run(_round(url, args.concurrency, 8, True))  # warm-up: grammar compile, first steps
        asyncio.run(_round(url, args.concurrency, 8, False))
        for r in range(args.rounds):
            for constrained in ((False, True) if r % 2 == 0 else (True, False)):
                load = os.getloadavg()[0]
                tokens, dt = asyncio.run(_round(url, args.concurrency, args.max_tokens, constrained))
                arm = "json_schema" if constrained else "free"
                rows.append((arm, tokens, dt, load))
                print(f"round {r} {arm:11s} {tokens} tokens in {dt:.2f} s = {tokens / dt:.0f} tok/s (load {load:.1f})",
                      flush=True)
    finally:
        stop_all([proc])
    free = [t / d for a, t, d, _ in rows if a == "free"]
    cons = [t / d for a, t, d, _ in rows if a == "json_schema"]
    ratios = [c / f for f, c in zip(free, cons, strict=True)]
    summary = (f"json_schema / free tokens/s per round: median {statistics.median(ratios):.3f}, "
               f"range {min(ratios):.3f}-{max(ratios):.3f} ({len(ratios)} rounds; target: at most 10% lower, "
               "i.e. >= 0.90)")
    # The grammar work alone, against the free arm's step time (wall time / steps of a round).
    cost = mask_cost(args.concurrency, args.max_tokens)
    step_s = [d / args.max_tokens for a, _, d, _ in rows if a == "free"]
    summary += (f"\ngrammar work alone ({args.concurrency} rows: fill + apply masks, accept tokens): median "
                f"{1e3 * statistics.median(cost):.2f} ms per step (p90 {1e3 * sorted(cost)[int(0.9 * len(cost))]:.2f}); "
                f"free steps took {1e3 * min(step_s):.1f}-{1e3 * max(step_s):.1f} ms, so "
                f"{100 * statistics.median(cost) / max(step_s):.1f}-{100 * statistics.median(cost) / min(step_s):.1f}% "
                "of a step")
    print(summary)
    if args.write:
        cmd = "python bench/bench_serve_structured.py " + " ".join(argv if argv is not None else sys.argv[1:])
        lines = [SECTION, "", f"`{cmd.strip()}`: the bundled model, {args.concurrency} concurrent chat requests of "
                 f"{args.max_tokens} tokens each, free (EOS ignored) vs `response_format: json_schema` (an "
                 "array of at least 1,000 short strings, so no request ends early); arms alternated per round. "
                 "Machine shared with other jobs (1-minute load beside each row).", "",
                 "| round | arm | tokens | seconds | tokens/s | load |", "|---|---|---|---|---|---|"]
        for i, (arm, tokens, dt, load) in enumerate(rows):
            lines.append(f"| {i // 2} | {arm} | {tokens} | {dt:.2f} | {tokens / dt:.0f} | {load:.1f} |")
        lines += ["", summary.replace("\n", "\n\n") + ".", ""]
        text = OUT.read_text()
        if SECTION in text:  # replace the old section (it runs to the next "## " heading or the end)
            start = text.index(SECTION)
            nxt = text.find("\n## ", start + len(SECTION))
            text = text[:start] + "\n".join(lines) + (text[nxt + 1:] if nxt >= 0 else "")
        else:
            text = text.rstrip("\n") + "\n\n" + "\n".join(lines)
        OUT.write_text(text)
        print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
