"""One engine job for the tensor-parallel tests: two rounds of a mixed batch through the offline API.

A tensor-parallel engine makes a process group (and on the bridge's device joins JAX's distributed
runtime, which a process can do once, before it first uses the device), so test_tensor_parallel.py
runs it in a process of its own: `python tp_job.py OUT.json MODEL_DIR N DEVICE [ENGINE_ARGS_JSON]`.
The single-rank reference is the same `run()`, called in the test's process.

Round 1: prompts of different lengths, some longer than the step's token budget (chunked prefill, so
steps mix prefill chunks with decodes), with different token limits (some stop after 1 or 2 tokens
while others go on; the model's end-of-sequence token stops any). Round 2: prompts that share full
blocks with round 1's (prefix-cache hits) next to new ones.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_support import mixed_prompts  # noqa: E402

MAX_NEW = (10, 1, 4, 10, 2)  # per prompt, in turn


def max_new(i: int) -> int:
    return MAX_NEW[i % len(MAX_NEW)]
ENGINE_ARGS = {"block_size": 4, "num_blocks": 128, "max_model_len": 96, "max_num_seqs": 8,
               "max_num_batched_tokens": 16}


def prompts(vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    first = mixed_prompts(6, vocab=min(vocab, 320), lo=3, hi=40)
    second = [first[0] + [11, 12, 13], first[1], first[2][:9], *mixed_prompts(2, vocab=min(vocab, 320), seed=7)]
    return first, second


def run(model_dir: str, tp: int, device: str, **engine_args: object) -> dict:
    from torchbridge.serve import LLM, SamplingParams

    llm = LLM(model_dir, device=device, tensor_parallel_size=tp, **{**ENGINE_ARGS, **engine_args})
    eng = llm.engine
    runner = eng.runner
    steps: list[tuple[int, int]] = []  # per step: (decode items, prefill-chunk items)
    execute = runner.execute

    def recorded(step, *args):  # noqa: ANN001, ANN002, ANN202
        steps.append((sum(len(s.tokens) == 1 for s in step), sum(len(s.tokens) > 1 for s in step)))
        return execute(step, *args)

    runner.execute = recorded
    rounds, reasons = [], []
    try:
        for batch in prompts(eng.config.model_config.vocab_size):
            params = [SamplingParams(temperature=0, max_tokens=max_new(i)) for i in range(len(batch))]
            outs = llm.generate(batch, params)
            rounds.append([o.outputs[0].token_ids for o in outs])
            reasons.append([o.outputs[0].finish_reason for o in outs])
        attn = runner.model.model.layers[0].self_attn
        return {
            "rounds": rounds,
            "finish_reasons": reasons,
            "prefix_hits": eng.block_manager.prefix_hits,
            "mixed_steps": sum(1 for d, p in steps if d and p),
            "local_kv_heads": runner.kv_caches[0][0].shape[2],
            "local_qkv_rows": attn.qkv_proj.weight.shape[0],
            "worker_pids": [] if runner.workers is None else runner.workers.pids,
            "compile": _compile_info(device),
        }
    finally:
        eng.shutdown()


def _compile_info(device: str) -> dict:
    if device == "cpu":
        return {}
    import torch._dynamo.utils

    from torchbridge.compile import metrics

    m = metrics()
    return {"graphs": m["graphs_compiled"], "collective_graphs": m["collective_graphs"],
            "collectives": m["collectives"], "graph_breaks": sum(torch._dynamo.utils.counters["graph_break"].values())}


if __name__ == "__main__":
    out, model_dir, tp, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
    extra = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    Path(out).write_text(json.dumps(run(model_dir, tp, device, **extra)))
