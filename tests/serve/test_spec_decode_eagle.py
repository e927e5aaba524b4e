"""Speculative decoding with an EAGLE head (serve/models/eagle.py, spec_decode.EagleProposer).

References: Hugging Face's generate() for the outputs, and for the drafts themselves the head's training
twin built from Hugging Face's Llama modules (torchbridge.train.eagle_head), run over the whole sequence
from the Hugging Face target's features: it shares no code with the engine's head, its KV pool or the
feature bookkeeping between steps."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from serve_support import hf_greedy, hf_model, mixed_prompts

from torchbridge.serve import LLM, SamplingParams, default_eagle_dir, default_model_dir
from torchbridge.train.eagle_head import EagleHead

MAX_NEW = 20


def save_head(out_dir: Path, target_dir: Path, seed: int) -> Path:
    """A random-init EAGLE head for the target in `target_dir`, in the layout the training script writes."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    cfg_dict = json.loads((target_dir / "config.json").read_text())
    cfg = LlamaConfig(**{**cfg_dict, "num_hidden_layers": 1})
    torch.manual_seed(seed)
    head = EagleHead(cfg, hf_model(str(target_dir)))
    with torch.no_grad():  # wide, as serve_support.save_model: no near-ties for rounding to flip
        for p in head.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.15)
    save_file(head.state_for_checkpoint(), str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps({**cfg_dict, "num_hidden_layers": 1}))
    return out_dir


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory: pytest.TempPathFactory, llama_dir: Path) -> Path:
    return save_head(tmp_path_factory.mktemp("eagle"), llama_dir, seed=11)


def eagle(head: Path, k: int = 3) -> dict:
    return {"method": "eagle", "model": str(head), "num_speculative_tokens": k}


def twin(target_dir: Path, head: Path) -> EagleHead:
    """The head's checkpoint loaded into the Hugging Face twin."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    cfg_dict = json.loads((head / "config.json").read_text())
    cfg_dict.pop("dtype", None)
    model = EagleHead(LlamaConfig(**cfg_dict), hf_model(str(target_dir)))
    state = load_file(str(head / "model.safetensors"))
    model.fc.load_state_dict({"weight": state.pop("fc.weight")})
    model.body.layers.load_state_dict({k.removeprefix("layers."): v for k, v in state.items()})
    return model.float().eval()


@torch.no_grad()
def reference_drafts(target_dir: Path, head: EagleHead, tokens: list[int], k: int) -> list[int]:
    """Greedy EAGLE drafting from scratch: the head over every position with the target's features, its
    prediction for the last one gives the first draft; each draft and predicted feature are appended."""
    target = hf_model(str(target_dir))
    feats = target.model(torch.tensor([tokens])).last_hidden_state[:, :-1]  # f_0 .. f_{C-1}
    ids = torch.tensor([tokens[1:]])  # the next token of each position
    out = []
    for _ in range(k):
        pred = head(ids, feats)[:, -1:]
        out.append(int(target.lm_head(pred)[0, -1].argmax()))
        ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
        feats = torch.cat([feats, pred], dim=1)
    return out


def record_proposals(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """(the sequence's tokens when proposing, the drafts) for every greedy proposal the engine makes."""
    proposer = llm.engine.proposer
    seen: list[tuple[list[int], list[int]]] = []
    propose = proposer.propose

    def spy(items, sampler):  # noqa: ANN001, ANN202
        before = [list(it.seq.token_ids) for it in items]
        out = propose(items, sampler)
        seen.extend((toks, list(it.draft_tokens)) for toks, it in zip(before, items, strict=True) if it.draft_tokens)
        return out

    proposer.propose = spy
    return seen


def test_greedy_equals_hf_generate_with_an_eagle_head(llama_dir: Path, head_dir: Path) -> None:
    """A mixed batch, prefill in chunks of 8 tokens (features of earlier chunks wait for the head)."""
    prompts = mixed_prompts(4, seed=3) + [[7, 8, 9, 10] * 6]
    expected = [hf_greedy(llama_dir, p, MAX_NEW) for p in prompts]
    llm = LLM(str(llama_dir), block_size=4, num_blocks=128, max_model_len=96, max_num_batched_tokens=8,
              speculative_config=eagle(head_dir))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == expected
    st = llm.engine.spec_stats
    assert st.num_draft_tokens > 0 and sum(st.accepted_per_pos) == st.num_accepted_tokens


def test_drafts_equal_the_hugging_face_twin(llama_dir: Path, head_dir: Path) -> None:
    """Every proposal's drafts (three per step, two sequences side by side) equal the twin's from scratch."""
    llm = LLM(str(llama_dir), block_size=4, num_blocks=128, max_model_len=96, speculative_config=eagle(head_dir))
    seen = record_proposals(llm)
    llm.generate([[5, 6, 7, 8, 9], [40, 41, 42, 43] * 3], SamplingParams(temperature=0, max_tokens=12))
    assert len(seen) >= 10
    head = twin(llama_dir, head_dir)
    for tokens, drafts in seen:
        assert drafts == reference_drafts(llama_dir, head, tokens, len(drafts)), tokens


@pytest.mark.skipif(not (default_eagle_dir() / "model.safetensors").is_file(), reason="no bundled EAGLE head")
def test_the_bundled_head_drafts_as_its_twin_and_is_accepted() -> None:
    """The bundled model with its bundled head: drafts equal the twin's (so accepted drafts' features, which
    a random head never gets, are handed over right), outputs equal HF's, and the head is mostly accepted."""
    target = default_model_dir()
    llm = LLM(str(target), max_model_len=256, speculative_config=eagle(default_eagle_dir(), k=4))
    seen = record_proposals(llm)
    prompts = ["def read_config(path):\n", "class LRUCache:\n    def __init__(self, capacity):\n"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for o in outs:
        assert o.outputs[0].token_ids == hf_greedy(target, o.prompt_token_ids, 40)
    st = llm.engine.spec_stats
    assert st.acceptance_rate > 0.3, st
    head = twin(target, default_eagle_dir())
    for tokens, drafts in seen[:12]:
        assert drafts == reference_drafts(target, head, tokens, len(drafts)), tokens


def test_eagle_survives_preemption_and_prefix_cache(llama_dir: Path, head_dir: Path) -> None:
    """A tiny pool (preemption drops a sequence's pending features with its blocks) and a prompt whose
    prefix is cached (the target never computes those positions' features): outputs still greedy."""
    prompts = mixed_prompts(6, seed=4, lo=10, hi=20)
    llm = LLM(str(llama_dir), block_size=4, num_blocks=20, max_model_len=64, max_num_seqs=6,
              speculative_config=eagle(head_dir))
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    refs = [hf_greedy(llama_dir, p, 16) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == refs
    again = llm.generate([prompts[0] + refs[0][:4]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert llm.engine.block_manager.prefix_hits > 0
    assert again[0].outputs[0].token_ids == refs[0][4:]


def test_sampled_requests_speculate_with_the_head(llama_dir: Path, head_dir: Path) -> None:
    llm = LLM(str(llama_dir), block_size=4, num_blocks=128, max_model_len=96, speculative_config=eagle(head_dir, k=4))
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=24, ignore_eos=True)
    a = llm.generate([[5, 6, 7], [40, 41, 42, 43]], params)
    assert llm.engine.spec_stats.num_draft_tokens > 20
    b = llm.generate([[5, 6, 7], [40, 41, 42, 43]], params)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]  # seeded: reproducible
    assert all(len(o.outputs[0].token_ids) == 24 for o in a)


def test_a_head_that_does_not_fit_the_target_is_refused(tmp_path: Path, llama_dir: Path, head_dir: Path) -> None:
    cfg = json.loads((head_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 500}))
    (tmp_path / "model.safetensors").write_bytes((head_dir / "model.safetensors").read_bytes())
    with pytest.raises(ValueError, match="EAGLE head's vocabulary"):
        LLM(str(llama_dir), speculative_config=eagle(tmp_path))
    with pytest.raises(ValueError, match="eagle needs `model`"):
        LLM(str(llama_dir), speculative_config={"method": "eagle"})


def test_eagle_on_the_bridge_device(llama_dir: Path, head_dir: Path) -> None:
    """On the bridge's device both steps are compiled and replayed per bucket; the target's step then also
    returns its hidden states, and the head's step takes them as an input: tokens still equal HF's."""
    import torchbridge

    if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
        pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}")
    llm = LLM(str(llama_dir), device=torchbridge.device_name(), block_size=16, num_blocks=24, max_model_len=48,
              max_num_seqs=2, speculative_config=eagle(head_dir))
    assert llm.engine.runner.config.compile_model and llm.engine.proposer.runner.config.compile_model
    prompts = mixed_prompts(2, seed=5, hi=16)
    for _ in range(2):  # the second time through replays
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12))
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(llama_dir, p, 12) for p in prompts]
    assert llm.engine.spec_stats.num_draft_tokens > 0
    for runner in (llm.engine.runner, llm.engine.proposer.runner):  # both steps' buckets replay
        assert any(rep is not None for rep in runner._replays.values())
