"""The sampler's transforms against Hugging Face's logits processors and warpers."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from torchbridge.serve.sampler import Sampler
from torchbridge.serve.sampling_params import SamplingParams
from torchbridge.serve.sequence import Sequence


def make_seq(params: SamplingParams, prompt: list[int], output: list[int]) -> Sequence:
    s = Sequence("r", 0, prompt, params)
    s.token_ids += output
    return s


@pytest.mark.parametrize(
    "temperature, top_k, top_p, min_p",
    [(0.7, -1, 1.0, 0.0), (1.0, 5, 1.0, 0.0), (1.3, -1, 0.8, 0.0), (0.9, 20, 0.6, 0.0), (1.0, -1, 1.0, 0.1),
     (0.5, 10, 0.9, 0.05)],
)
def test_filtered_distribution_matches_hf_warpers(temperature: float, top_k: int, top_p: float, min_p: float) -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 64, generator=g) * 3
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    seqs = [make_seq(params, [1, 2], []) for _ in range(3)]
    ours = Sampler._probs(logits.clone(), seqs)
    ref = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k > 0:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1:
        ref = TopPLogitsWarper(top_p)(None, ref)
    if min_p > 0:
        ref = MinPLogitsWarper(min_p)(None, ref)
    torch.testing.assert_close(ours, ref.softmax(-1), atol=1e-6, rtol=1e-5)


def test_repetition_penalty_matches_hf() -> None:
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(repetition_penalty=1.7)
    seq = make_seq(params, [3, 4, 5, 3], [9, 10])
    ours = Sampler().process(logits, [seq])
    ref = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([seq.token_ids]), logits.clone())
    torch.testing.assert_close(ours, ref)


def test_presence_and_frequency_penalties_follow_openai_formula() -> None:
    logits = torch.zeros(1, 20)
    seq = make_seq(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), [1, 2, 3], [7, 7, 8])
    ours = Sampler().process(logits, [seq])[0]
    # OpenAI: mu[j] - c[j] * frequency - (c[j] > 0) * presence, over the generated tokens only.
    expected = torch.zeros(20)
    expected[7] = -(2 * 0.25 + 0.5)
    expected[8] = -(1 * 0.25 + 0.5)
    torch.testing.assert_close(ours, expected)


def test_seeded_sampling_is_reproducible_and_follows_the_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0, seed=7)
    draws = []
    for _ in range(2):
        s = make_seq(params, [1], [])
        draws.append([Sampler().sample(logits, [s])[0].token_id for _ in range(200)])
    assert draws[0] == draws[1]
    freq = torch.bincount(torch.tensor(draws[0]), minlength=4).float() / 200
    # Loose bound (4.5 sigma at n = 200) against the softmax probabilities.
    torch.testing.assert_close(freq, logits.softmax(-1)[0], atol=0.16, rtol=0)


def test_min_tokens_bans_eos_until_reached() -> None:
    logits = torch.tensor([[0.0, 5.0, 1.0]])  # token 1 (EOS) would win
    seq = make_seq(SamplingParams(temperature=0, min_tokens=2), [2], [2])
    assert Sampler(eos_token_ids=[1]).sample(logits, [seq])[0].token_id == 2
    seq.token_ids.append(2)
    assert Sampler(eos_token_ids=[1]).sample(logits, [seq])[0].token_id == 1
