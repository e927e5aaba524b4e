"""End to end through the offline API against Hugging Face generate(): continuous batching of mixed
prompts, prefix caching, chunked prefill, speculative decoding, shape buckets, preemption, cancellation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from serve_support import DEVICES, hf_greedy, hf_logits, mixed_prompts

from torchbridge.serve import LLM, SamplingParams

MAX_NEW = 12

VARIANTS = {
    "default": {},
    "no-prefix-caching": {"enable_prefix_caching": False},
    "chunked-prefill": {"max_num_batched_tokens": 8},
    "speculative-ngram": {"speculative_ngram": 3},
    "shape-buckets": {"shape_buckets": True},
    "workspace-decode": {"cpu_kernels": False},
    "gather-decode": {"cpu_kernels": False, "decode_workspace": False},
}


@pytest.fixture(scope="module")
def references(llama_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    # Repetitive prompts give the n-gram proposer something to find; a shared prefix exercises the cache.
    prompts = mixed_prompts(5)
    prompts += [[7, 8, 9, 10] * 6, prompts[0] + [11, 12, 13], [20, 21, 22, 23, 24, 25] * 3 + [20, 21]]
    return prompts, [hf_greedy(llama_dir, p, MAX_NEW) for p in prompts]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_greedy_matches_hf_generate(llama_dir: Path, references: tuple, variant: str, device: str) -> None:
    prompts, expected = references
    llm = LLM(str(llama_dir), device=device, block_size=4, num_blocks=128, max_model_len=96, **VARIANTS[variant])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    got = [o.outputs[0].token_ids for o in outs]
    assert got == expected
    if variant == "speculative-ngram":
        st = llm.engine.spec_stats
        assert llm.engine.proposer is not None and st.num_draft_tokens > 0
        assert st.num_accepted_tokens <= st.num_draft_tokens
    if variant == "chunked-prefill":
        # Some prompt needed several steps before its first token.
        assert max(len(p) for p in prompts) > 8


@pytest.mark.parametrize("device", DEVICES)
def test_prefix_cache_computes_only_new_tokens(llama_dir: Path, device: str) -> None:
    llm = LLM(str(llama_dir), device=device, block_size=4, num_blocks=64, max_model_len=96)
    eng = llm.engine
    prompt = list(range(30, 60))  # 30 tokens: 7 full blocks of 4 can be shared
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    computed = eng.stats.computed_prompt_tokens
    assert computed == 30
    second = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    assert eng.stats.computed_prompt_tokens - computed == 30 - 28
    assert eng.block_manager.prefix_hits == 28 and eng.block_manager.prefix_queries == 60
    assert first == second == hf_greedy(llama_dir, prompt, 4)
    # A longer prompt with the same 30-token start reuses those blocks too.
    computed = eng.stats.computed_prompt_tokens
    longer = prompt + [61, 62, 63, 64, 65]
    out = llm.generate([longer], SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    assert eng.stats.computed_prompt_tokens - computed == 35 - 28
    assert out == hf_greedy(llama_dir, longer, 4)


@pytest.mark.parametrize("device", DEVICES)
def test_preemption_under_tiny_kv_pool(llama_dir: Path, device: str) -> None:
    prompts = mixed_prompts(6, seed=4, lo=10, hi=20)
    # 14 blocks of 4 tokens hold ~2 sequences at full length: the batch of 6 must preempt and recompute.
    llm = LLM(str(llama_dir), device=device, block_size=4, num_blocks=14, max_model_len=64, max_num_seqs=6)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].finish_reason == "length"
        ref = hf_model_greedy_no_eos(llama_dir, p, 16)
        assert o.outputs[0].token_ids == ref
    assert llm.engine.block_manager.usage == 0.0


def hf_model_greedy_no_eos(model_dir: Path, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf_logits(model_dir, ids)[-1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("kernel", [True, False], ids=["decode-kernel", "workspace"])
def test_varied_output_lengths_with_requests_joining(llama_dir: Path, kernel: bool) -> None:
    """Requests finish at different steps while waiting ones join (3 slots): the decode kernel's rows
    change every step; decode-workspace rows are freed, compacted and refilled from the paged cache; every
    output still matches Hugging Face."""
    prompts = mixed_prompts(7, seed=6, lo=4, hi=30)
    lens = [3, 17, 9, 1, 12, 5, 14]
    llm = LLM(str(llama_dir), block_size=4, num_blocks=128, max_model_len=96, max_num_seqs=3,
              enable_prefix_caching=False, cpu_kernels=kernel)
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens])
    runner = llm.engine.runner
    assert runner.decode_kernel == kernel
    assert kernel or (runner.workspace is not None and runner.workspace.rows > 0)
    for p, n, o in zip(prompts, lens, outs, strict=True):
        assert o.outputs[0].token_ids == hf_model_greedy_no_eos(llama_dir, p, n)


def test_lone_sequence_larger_than_pool_finishes_with_length(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), block_size=4, num_blocks=4, max_model_len=64)
    out = llm.generate([[5, 6, 7, 8, 9]], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0].outputs[0]
    # 16 cache slots: 16 computed tokens plus the one sampled from the last of them.
    assert out.finish_reason == "length" and len(out.token_ids) == 16 - 5 + 1
    assert out.token_ids == hf_model_greedy_no_eos(llama_dir, [5, 6, 7, 8, 9], 12)


def test_abort_frees_blocks_at_once(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), block_size=4, num_blocks=32, max_model_len=64, enable_prefix_caching=False)
    eng = llm.engine
    eng.add_request("a", list(range(10, 30)), SamplingParams(temperature=0, max_tokens=30))
    eng.add_request("b", list(range(40, 50)), SamplingParams(temperature=0, max_tokens=30))
    eng.step()
    eng.step()
    assert eng.block_manager.num_free_blocks < 32
    used_by_b = len(next(s for s in eng.scheduler.running if s.request_id == "b").block_table)
    free_before = eng.block_manager.num_free_blocks
    eng.abort_request("a")
    assert eng.block_manager.num_free_blocks == 32 - used_by_b > free_before
    assert [s.request_id for s in eng.scheduler.running] == ["b"]
    eng.abort_request("b")
    assert eng.block_manager.num_free_blocks == 32 and not eng.has_unfinished()


def test_sampling_options(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), block_size=4, num_blocks=128, max_model_len=96)
    prompt = [40, 41, 42, 43, 44, 45]
    greedy = hf_model_greedy_no_eos(llama_dir, prompt, 8)
    # top_k=1 sampling at any temperature is greedy.
    out = llm.generate([prompt], SamplingParams(temperature=1.5, top_k=1, max_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids == greedy
    # A seed makes sampling reproducible regardless of the batch it runs in; n > 1 gives n choices.
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True, n=3)
    a = llm.generate([prompt], p)[0].outputs
    b = llm.generate([[9, 9, 9], prompt], [SamplingParams(temperature=1.0, max_tokens=5), p])[1].outputs
    assert [c.token_ids for c in a] == [c.token_ids for c in b] and len(a) == 3
    assert len({tuple(c.token_ids) for c in a}) > 1
    # Stop token ids end the output (the stop token is kept among the ids, not in the text).
    stop_at = greedy[3]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, stop_token_ids=[stop_at]))[0].outputs[0]
    assert out.token_ids == greedy[: greedy.index(stop_at) + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_at
    # Logprobs: the chosen token's logprob and the top-k under the model's distribution (HF logits).
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0].outputs[0]
    ref = torch.log_softmax(hf_logits(llama_dir, prompt + greedy[:4]), dim=-1)[len(prompt) - 1 : -1]
    for i, lp in enumerate(out.logprobs):
        assert lp["token"] == greedy[i]
        assert abs(lp["logprob"] - float(ref[i, greedy[i]])) < 1e-4
        assert [t for t, _ in lp["top"]] == ref[i].topk(3).indices.tolist()


def test_stop_strings_cut_the_text(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), block_size=4, num_blocks=128, max_model_len=96)
    tok = llm.tokenizer
    prompt = tok.encode("Once upon a time")
    full = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    text = tok.decode(full.token_ids)
    assert full.text == text
    stop = text[5:8]
    if not stop.strip():
        pytest.skip("the greedy text has whitespace where the stop string would go")
    cut = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert cut.text == text[: text.index(stop)] and cut.finish_reason == "stop" and cut.stop_reason == stop


def test_invalid_requests_are_refused(llama_dir: Path) -> None:
    from torchbridge.serve.engine import InvalidRequest

    llm = LLM(str(llama_dir), block_size=4, num_blocks=32, max_model_len=32)
    with pytest.raises(InvalidRequest):
        llm.engine.add_request("x", [], SamplingParams())
    with pytest.raises(InvalidRequest):
        llm.engine.add_request("y", list(range(3, 40)), SamplingParams())
    with pytest.raises(ValueError):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError):
        SamplingParams(top_p=0)
    assert not llm.engine.has_unfinished()


def test_shape_buckets_keep_decode_steps_on_warmed_shapes(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), block_size=4, num_blocks=64, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32, shape_buckets=True)
    runner = llm.engine.runner
    assert runner.warmup(4, 32, progress=False) == len(runner.shapes_warmed) > 0
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == [hf_model_greedy_no_eos(llama_dir, p, 20) for p in prompts]
    # A decode-only step has one attention group of query length 1.
    decode_shapes = {k for k in runner.shapes_seen if len(k) == 6 and k[3] == 1}
    assert decode_shapes and decode_shapes <= runner.shapes_warmed
    for key in runner.shapes_seen:
        assert all(x & (x - 1) == 0 for x in key), key  # every dimension is a power-of-two bucket
