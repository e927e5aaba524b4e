"""Speculative decoding: the rejection sampler's output distribution (chi-square against the exact
target distribution of a Markov chain, and the same test failing when the acceptance rule is broken),
greedy outputs equal to Hugging Face generate() with every method, a draft model equal to the target
accepting everything, sampled requests through the engine following HF's distribution, and vLLM's
--speculative-config parsing."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
from serve_support import hf_greedy, hf_logits, mixed_prompts, save_model

from torchbridge.serve import LLM, SamplingParams, spec_decode
from torchbridge.serve.spec_decode import SpeculativeConfig, rejection_sample

MAX_NEW = 12


def chi2_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square test of counts against exact probabilities; the p-value from the regularised
    incomplete gamma function. Cells expected to hold fewer than 5 counts are pooled into one (the usual
    rule for the approximation); a count in a cell of probability 0 fails outright."""
    observed, probs = observed.double().flatten(), probs.double().flatten()
    assert observed[probs == 0].sum() == 0, "a token of probability 0 was sampled"
    n = observed.sum()
    expected = probs * n
    small = (expected < 5) & (probs > 0)
    big = expected >= 5
    obs = torch.cat([observed[big], observed[small].sum()[None]]) if small.any() else observed[big]
    exp = torch.cat([expected[big], expected[small].sum()[None]]) if small.any() else expected[big]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = obs.numel() - 1
    assert dof >= 2, "too few samples for a chi-square test"
    return float(1 - torch.special.gammainc(torch.tensor(dof / 2, dtype=torch.float64), stat / 2))


def simulate(p: torch.Tensor, q: torch.Tensor, k: int, n: int, length: int, deterministic: bool,
             seed: int = 0) -> torch.Tensor:
    """n independent speculative generations of `length` tokens from a Markov chain: the target's next-
    token distribution after token t is p[t], the draft's q[t]; every chain starts after token 0.
    Returns the first `length` tokens of each chain [n, length]."""
    g = torch.Generator().manual_seed(seed)
    buf = torch.zeros((n, length * (k + 1)), dtype=torch.long)
    lens = torch.zeros(n, dtype=torch.long)
    last = torch.zeros(n, dtype=torch.long)
    rows = torch.arange(n)
    while int(lens.min()) < length:
        drafts, q_rows, prev = [], [], last
        for _ in range(k):
            qd = q[prev]
            d = qd.argmax(-1) if deterministic else torch.multinomial(qd, 1, generator=g).squeeze(-1)
            drafts.append(d)
            q_rows.append(qd)
            prev = d
        draft = torch.stack(drafts, 1)
        target = p[torch.cat([last[:, None], draft], 1)]  # [n, k+1, V]: p after each fed token
        toks, acc = rejection_sample(target, draft, None if deterministic else torch.stack(q_rows, 1), g)
        idx = lens[:, None] + torch.arange(k + 1)
        valid = (torch.arange(k + 1)[None] <= acc[:, None]) & (idx < buf.shape[1])
        buf[rows[:, None].expand_as(idx)[valid], idx[valid]] = toks[valid]
        lens += acc + 1
        last = toks[rows, acc]
    return buf[:, :length]


def chain(vocab: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(vocab, vocab, generator=g) * 1.2).softmax(-1)
    q = (torch.randn(vocab, vocab, generator=g) * 1.2).softmax(-1)
    return p.double(), q.double()


def joint_test(deterministic: bool, n: int = 40000) -> float:
    """p-value of the first three emitted tokens against the chain's exact joint distribution (64 cells):
    this covers accepted drafts, resampled rejections and bonus tokens alike."""
    p, q = chain()
    v = p.shape[0]
    out = simulate(p, q, k=3, n=n, length=3, deterministic=deterministic)
    codes = out[:, 0] * v * v + out[:, 1] * v + out[:, 2]
    observed = torch.bincount(codes, minlength=v**3)
    exact = (p[0][:, None, None] * p[:, :, None] * p[None, :, :]).flatten()  # p(x1|0) p(x2|x1) p(x3|x2)
    return chi2_pvalue(observed, exact)


@pytest.mark.parametrize("deterministic", [False, True], ids=["draft-distribution", "one-hot-draft"])
def test_rejection_sampler_output_follows_the_target(deterministic: bool) -> None:
    assert joint_test(deterministic) > 1e-3


@pytest.mark.parametrize("broken", ["accept-always", "ignore-draft-probability"])
def test_the_chi_square_test_catches_a_broken_acceptance_rule(monkeypatch: pytest.MonkeyPatch, broken: str) -> None:
    rule = {"accept-always": lambda u, p, q: torch.ones_like(p, dtype=torch.bool),
            "ignore-draft-probability": lambda u, p, q: u < p}[broken]
    monkeypatch.setattr(spec_decode, "_accept", rule)
    assert joint_test(deterministic=False) < 1e-6


def test_rejection_sampler_keeps_equal_distributions_whole() -> None:
    """Draft == target: every draft is accepted (p/q = 1), the bonus token comes from p."""
    p, _ = chain()
    g = torch.Generator().manual_seed(1)
    draft = torch.multinomial(p[0], 3000, replacement=True, generator=g).view(1000, 3)
    target = torch.stack([p[0]] * 4)[None].expand(1000, 4, -1)
    toks, acc = rejection_sample(target, draft, target[:, :3], g)
    assert bool((acc == 3).all()) and torch.equal(toks[:, :3], draft)


# ---- the engine -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Path:
    """A different, smaller random model with the target's vocabulary (few drafts accepted)."""
    return save_model(tmp_path_factory.mktemp("draft"), "llama", tokenizer_dir, seed=7, num_hidden_layers=1,
                      hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def references(llama_dir: Path) -> tuple[list[list[int]], list[list[int]]]:
    prompts = mixed_prompts(4, seed=3)
    prompts += [[7, 8, 9, 10] * 6, [20, 21, 22, 23, 24, 25] * 3 + [20, 21]]
    return prompts, [hf_greedy(llama_dir, p, MAX_NEW) for p in prompts]


def spec(method: str, llama_dir: Path, draft_dir: Path, k: int = 3) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k}
    return {"method": "draft_model", "num_speculative_tokens": k,
            "model": str(llama_dir if method == "draft-self" else draft_dir)}


@pytest.mark.parametrize("method", ["ngram", "draft-other", "draft-self"])
def test_greedy_equals_hf_generate_with_speculation(llama_dir: Path, draft_dir: Path, references: tuple,
                                                     method: str) -> None:
    prompts, expected = references
    llm = LLM(str(llama_dir), block_size=4, num_blocks=128, max_model_len=96,
              speculative_config=spec(method, llama_dir, draft_dir))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == expected
    st = llm.engine.spec_stats
    assert st.num_draft_tokens > 0 and 0 <= st.num_accepted_tokens <= st.num_draft_tokens
    assert sum(st.accepted_per_pos) == st.num_accepted_tokens
    if method == "draft-self":
        # The draft is the target: its K/V bookkeeping over the shared block tables is right exactly
        # when its guesses are the target's own greedy tokens.
        assert st.acceptance_rate == 1.0
        assert st.mean_acceptance_length > 2


def test_draft_model_survives_preemption_and_prefix_cache(llama_dir: Path) -> None:
    """A tiny pool (preemption frees blocks that held the draft's K/V too) and shared prompt prefixes
    (cached blocks the draft fills in itself): outputs still greedy, and a self-draft still accepts all."""
    prompts = mixed_prompts(6, seed=4, lo=10, hi=20)
    llm = LLM(str(llama_dir), block_size=4, num_blocks=20, max_model_len=64, max_num_seqs=6,
              speculative_config={"model": str(llama_dir), "num_speculative_tokens": 3})
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    refs = []
    for p, o in zip(prompts, outs, strict=True):
        ids = list(p)
        for _ in range(16):
            ids.append(int(hf_logits(llama_dir, ids)[-1].argmax()))
        refs.append(ids[len(p) :])
        assert o.outputs[0].token_ids == refs[-1]
    assert llm.engine.spec_stats.acceptance_rate == 1.0
    # One request after another in a roomy pool: the second prompt's blocks come from the prefix cache
    # (the target's K/V), and the draft fills its own pool for them itself.
    llm = LLM(str(llama_dir), block_size=4, num_blocks=64, max_model_len=64,
              speculative_config={"model": str(llama_dir), "num_speculative_tokens": 3})
    first = llm.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    again = llm.generate([prompts[0] + refs[0][:4]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert llm.engine.block_manager.prefix_hits > 0
    assert first[0].outputs[0].token_ids == refs[0] and again[0].outputs[0].token_ids == refs[0][4:]
    assert llm.engine.spec_stats.acceptance_rate == 1.0


def test_sampled_requests_speculate_and_a_self_draft_accepts_nearly_all(llama_dir: Path) -> None:
    llm = LLM(str(llama_dir), block_size=4, num_blocks=128, max_model_len=96,
              speculative_config={"model": str(llama_dir), "num_speculative_tokens": 4})
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=24, ignore_eos=True)
    a = llm.generate([[5, 6, 7], [40, 41, 42, 43]], params)
    st = llm.engine.spec_stats
    # p and q are the same model's distributions (up to rounding between batch shapes): min(1, p/q) ~ 1.
    assert st.num_draft_tokens > 20 and st.acceptance_rate > 0.97
    b = llm.generate([[5, 6, 7], [40, 41, 42, 43]], params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]  # seeded: reproducible
    assert all(len(o.outputs[0].token_ids) == 24 for o in a)
    # n-gram drafts for sampled requests (q one-hot): verified, and the outputs reproducible too.
    ngram = LLM(str(llama_dir), block_size=4, num_blocks=128, max_model_len=96, speculative_ngram=3)
    prompts = [[7, 8, 9, 10] * 6, [20, 21, 22] * 5]
    c = ngram.generate(prompts, SamplingParams(temperature=0.7, seed=2, max_tokens=30, ignore_eos=True))
    assert ngram.engine.spec_stats.num_draft_tokens > 0
    d = ngram.generate(prompts, SamplingParams(temperature=0.7, seed=2, max_tokens=30, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in c] == [o.outputs[0].token_ids for o in d]


def test_sampled_tokens_follow_hf_distribution(llama_dir: Path, draft_dir: Path) -> None:
    """Through the engine with a draft model: the joint distribution of output tokens 2 and 3 (the first
    verified ones; token 1 comes from the prefill) given token 1, over 600 sampled sequences (2,400 with
    TB_SLOW=1), against the exact top-3 distribution Hugging Face's logits give (chi-square)."""
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    requests = 20 if os.environ.get("TB_SLOW") == "1" else 5
    # n is at most 128 per request: requests of 120 choices, each choice with its own seeded stream.
    params = [SamplingParams(temperature=2.0, top_k=3, max_tokens=4, ignore_eos=True, n=120, seed=1000 * i)
              for i in range(requests)]
    llm = LLM(str(llama_dir), block_size=4, num_blocks=4096, max_model_len=32, max_num_seqs=512,
              max_num_batched_tokens=4096, speculative_config=spec("draft-other", llama_dir, draft_dir, k=2))
    outs = [c for r in llm.generate([prompt] * requests, params) for c in r.outputs]
    assert llm.engine.spec_stats.num_draft_tokens > 200 * requests

    def top3(ids: list[int]) -> torch.Tensor:
        logits = hf_logits(llama_dir, ids)[-1].double()
        probs = torch.zeros_like(logits)
        top = logits.topk(3)
        probs[top.indices] = (top.values / 2.0).softmax(-1)
        return probs

    first = torch.tensor([o.token_ids[0] for o in outs])
    x1 = int(torch.mode(first).values)  # the commonest first token: most samples to test
    rest = [o.token_ids[1:3] for o in outs if o.token_ids[0] == x1]
    p2 = top3(prompt + [x1])
    support = p2.nonzero().flatten().tolist()
    exact = torch.tensor([float(p2[a]) * float(top3(prompt + [x1, a])[b]) for a in support
                          for b in range(p2.shape[0])]).view(len(support), -1)
    observed = torch.zeros_like(exact)
    for a, b in rest:
        observed[support.index(a), b] += 1
    assert chi2_pvalue(observed, exact) > 1e-3


def test_speculative_config_parsing(llama_dir: Path) -> None:
    assert SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}') == \
        SpeculativeConfig("ngram", 4, None, 1, 5)
    # A model without a method is a draft model (vLLM's inference).
    cfg = SpeculativeConfig.parse({"model": str(llama_dir), "num_speculative_tokens": 2})
    assert cfg is not None and cfg.method == "draft_model"
    for bad, words in [({"method": "eagle3", "model": "x"}, "not implemented"),
                       ({"method": "ngram", "num_speculative_tokens": 0}, "at least 1"),
                       ({"method": "draft_model", "model": "/nonexistent"}, "checkpoint directory"),
                       ({"num_speculative_tokens": 2, "typo": 1}, "unknown keys ['typo']")]:
        with pytest.raises(ValueError, match=r".*" + words.replace("[", r"\[").replace("]", r"\]")):
            SpeculativeConfig.parse(bad)
    assert math.isclose(spec_decode.SpecStats(2, 6, 3).mean_acceptance_length, 2.5)
