"""Single-user decode tokens/s with each speculative method against none, with acceptance rates.

One request at a time (concurrency 1), greedy or sampled, on the bundled model by default; every arm in
a fresh process (or, with --warm, every arm's engine built and warmed once in this process: a server's
steady state), arms alternated per round, medians and ranges over rounds, the 1-minute load before each
run. Two prompt sets: the bundled model's own domain (Python source openings, where its output
repeats itself a lot: the repetition column is the fraction of output tokens whose preceding 3-gram
already occurred earlier in prompt + output, i.e. what n-gram lookup can exploit) and a less repetitive
one (plain-English prompts).

    python bench/bench_spec_decode.py --rounds 3 --max-tokens 128 \\
        --draft DIR_FROM_scripts/distill_draft.py --write docs/benchmarks/spec_decode.md
    python bench/bench_spec_decode.py --rounds 1 --max-tokens 16 --prompts 2    # a smoke run
    python bench/bench_spec_decode.py --warm --k 4,6 --rounds 3    # steady state, two k per method
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

PROMPT_SETS = {
    "python": ["def read_config(path):\n", "class LRUCache:\n    def __init__(self, capacity):\n",
               "import os\nimport sys\n\n\ndef main(argv):\n", "    for i, line in enumerate(lines):\n",
               "def _parse_header(data):\n    \"\"\"Parse", "class Request:\n    \"\"\"An HTTP request."],
    "english": ["The weather today is", "My favourite book tells the story of", "In the morning I usually",
                "The museum opened a new exhibition about", "She looked out of the window and",
                "Our team decided to"],
}


def repetition(ids: list[int], prompt_len: int, n: int = 3) -> float:
    seen: set[tuple[int, ...]] = set()
    hits = total = 0
    for i in range(n, len(ids)):
        gram = tuple(ids[i - n : i])
        if i >= prompt_len:
            total += 1
            hits += gram in seen
        seen.add(gram)
    return hits / total if total else 0.0


def engine(args: argparse.Namespace, spec: dict | None):  # noqa: ANN201 - torchbridge.serve.LLM
    """One single-user engine, warmed by one request of the measured length on a prompt outside the sets
    (first-call costs of every step shape out of the measurement)."""
    from torchbridge.serve import LLM, SamplingParams

    llm = LLM(args.model, max_num_seqs=1, max_model_len=1024, speculative_config=spec)
    llm.generate(["def warm_up(n):\n"], SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    return llm


def measure(llm, args: argparse.Namespace, prompt_set: str) -> dict:  # noqa: ANN001
    """Tokens/s over the prompt set, one request at a time (single-user latency), with the acceptance of
    this measurement alone."""
    from torchbridge.serve import SamplingParams

    prompts = PROMPT_SETS[prompt_set][: args.prompts]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    st = llm.engine.spec_stats
    base = (st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens)
    tokens, seconds, reps = 0, 0.0, []
    for p in prompts:
        t0 = time.perf_counter()
        out = llm.generate([p], params)[0]
        seconds += time.perf_counter() - t0
        ids = out.outputs[0].token_ids
        tokens += len(ids)
        reps.append(repetition(out.prompt_token_ids + ids, len(out.prompt_token_ids)))
    drafts, drafted, accepted = (a - b for a, b in zip((st.num_drafts, st.num_draft_tokens, st.num_accepted_tokens),
                                                       base, strict=True))
    return {"tok_s": tokens / seconds, "acceptance": accepted / drafted if drafted else None,
            "mean_len": 1 + accepted / drafts if drafts else None, "repetition": statistics.fmean(reps)}


def worker(args: argparse.Namespace) -> int:
    import torch

    torch.set_num_threads(args.threads)
    llm = engine(args, json.loads(args.spec) if args.spec else None)
    print(json.dumps(measure(llm, args, args.prompt_set)))
    return 0


def main(argv: list[str] | None = None) -> int:
    from torchbridge.serve import default_eagle_dir, default_model_dir

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(default_model_dir()))
    ap.add_argument("--draft", default=None, help="a draft checkpoint (scripts/distill_draft.py); default: none")
    ap.add_argument("--eagle", default=None,
                    help="an EAGLE head (scripts/distill_draft.py --method eagle); default: the bundled head with the "
                         "bundled model, else none; 'none' leaves the arm out")
    ap.add_argument("--k", default="4", help="num_speculative_tokens; a comma list (4,6) gives each method an arm per k")
    ap.add_argument("--warm", action="store_true",
                    help="every arm's engine in this one process, built and warmed once, then the rounds (arms "
                         "still alternated): a long-running server's steady state rather than a fresh process per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--write", type=Path, default=None)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompt-set", default="python", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return worker(args)
    ks = [int(k) for k in str(args.k).split(",")]
    eagle = args.eagle
    if eagle is None and Path(args.model).resolve() == default_model_dir().resolve() and default_eagle_dir().is_dir():
        eagle = str(default_eagle_dir())
    methods: list[tuple[str, dict]] = [("ngram", {"method": "ngram"})]
    if args.draft:
        methods.append(("draft_model", {"method": "draft_model", "model": args.draft}))
    if eagle and eagle != "none":
        methods.append(("eagle", {"method": "eagle", "model": eagle}))
    arms: dict[str, dict | None] = {"none": None}
    for name, spec in methods:
        for k in ks:
            arms[name if len(ks) == 1 else f"{name} k={k}"] = {**spec, "num_speculative_tokens": k}
    names = list(arms)
    rows: dict[tuple[str, str], list[dict]] = {}
    if args.warm:
        import torch

        torch.set_num_threads(args.threads)
        engines = {name: engine(args, spec) for name, spec in arms.items()}
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    for r in range(args.rounds):
        for prompt_set in PROMPT_SETS:
            for name in names if r % 2 == 0 else names[::-1]:
                load = os.getloadavg()[0]
                if args.warm:
                    res = measure(engines[name], args, prompt_set)
                else:
                    cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--max-tokens",
                           str(args.max_tokens), "--prompts", str(args.prompts), "--temperature", str(args.temperature),
                           "--threads", str(args.threads), "--prompt-set", prompt_set]
                    if arms[name]:
                        cmd += ["--spec", json.dumps(arms[name])]
                    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
                    res = json.loads(out.stdout.strip().splitlines()[-1])
                res["load"] = load
                rows.setdefault((prompt_set, name), []).append(res)
                print(f"round {r} {prompt_set} {name}: {res}", flush=True)
    lines = [f"Model {args.model}; single user, {args.prompts} prompts per set, {args.max_tokens} tokens each, "
             f"temperature {args.temperature}, k = {args.k}, {args.threads} thread(s); {args.rounds} rounds, arms "
             "alternated; " + ("every engine in one process, built and warmed once (--warm)" if args.warm else
                               "each arm's run a fresh process, warmed by one request") +
             "; median (range); vs none: median (range) of the per-round ratios.", "",
             "| prompts | method | tok/s | vs none | acceptance rate | mean acceptance length | repetition | loads |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for (prompt_set, name), rs in rows.items():
        none = rows[(prompt_set, "none")]
        ratios = [x["tok_s"] / n["tok_s"] for x, n in zip(rs, none, strict=True)]
        tok = [x["tok_s"] for x in rs]
        acc = [x["acceptance"] for x in rs if x["acceptance"] is not None]
        ml = [x["mean_len"] for x in rs if x["mean_len"] is not None]
        loads = ", ".join(f"{x['load']:.1f}" for x in rs)
        cells = [prompt_set, name, f"{statistics.median(tok):.1f} ({min(tok):.1f}-{max(tok):.1f})", f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
                 f"{statistics.median(acc):.3f}" if acc else "-", f"{statistics.median(ml):.2f}" if ml else "-",
                 f"{statistics.median(x['repetition'] for x in rs):.2f}", loads]
        lines.append("| " + " | ".join(cells) + " |")
    report = "\n".join(lines) + "\n"
    print(report)
    if args.write:
        cmd = "python bench/bench_spec_decode.py " + " ".join(argv if argv is not None else sys.argv[1:])
        args.write.write_text(f"# Speculative decoding, single user\n\nCommand: `{cmd}`\n\n{report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
