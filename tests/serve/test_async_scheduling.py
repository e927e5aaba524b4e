"""Async scheduling on the bridge's device (LLMEngine._step_async): step k is scheduled and prepared while
step k - 1 runs, and fed k - 1's tokens as they are sampled. A sequence that k - 1 ends was fed to k too, so
every way a sequence ends or stalls while a step is in flight is checked against Hugging Face's greedy
tokens: length, stop tokens, aborts, preemption in a small pool, and new prompts admitted into the blocks
that ending sequences freed."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_support import hf_greedy, mixed_prompts

from torchbridge.serve import LLM, SamplingParams
from torchbridge.serve.config import EngineConfig

torchbridge = pytest.importorskip("torchbridge")
if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

DEV = torchbridge.device_name()


def _llm(llama_dir: Path, **kw: object) -> LLM:
    args = dict(block_size=4, num_blocks=64, max_model_len=48, max_num_seqs=3, max_num_batched_tokens=32,
                enable_prefix_caching=False)
    return LLM(str(llama_dir), device=DEV, **{**args, **kw})


@pytest.fixture(scope="module")
def llm(llama_dir: Path) -> LLM:
    llm = _llm(llama_dir)
    assert llm.engine.async_scheduling  # the default on the device
    return llm


def _launched(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the steps started without waiting for them (a replayed step in flight)."""
    from torchbridge.compile import replay

    calls: list[int] = []
    launch = replay.Staged.launch
    monkeypatch.setattr(replay.Staged, "launch", lambda self: calls.append(1) or launch(self))
    return calls


def test_the_default_on_the_device_only_and_refused_where_it_cannot_run(llama_dir: Path) -> None:
    m = str(llama_dir)
    assert EngineConfig(model=m, device=DEV).async_scheduling is True
    assert EngineConfig(model=m, device="cpu").async_scheduling is False
    assert EngineConfig(model=m, device=DEV, speculative_ngram=2).async_scheduling is False
    assert EngineConfig(model=m, device=DEV, compile_model=False).async_scheduling is False
    assert EngineConfig(model=m, device=DEV, async_scheduling=False).async_scheduling is False
    with pytest.raises(ValueError, match="async_scheduling: it needs the bridge's device"):
        EngineConfig(model=m, device="cpu", async_scheduling=True)
    with pytest.raises(ValueError, match="async_scheduling: not with speculative decoding"):
        EngineConfig(model=m, device=DEV, speculative_ngram=2, async_scheduling=True)
    from torchbridge.serve.cli import _engine_config, build_parser

    for flags, want in (([], True), (["--no-async-scheduling"], False)):
        args = build_parser().parse_args(["--model", m, "--device", DEV, *flags])
        assert _engine_config(args, m).async_scheduling is want


def test_greedy_tokens_are_hf_while_sequences_end_and_new_ones_take_their_blocks(
        llm: LLM, llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # 7 prompts through 3 slots, each with its own length: most steps have a sequence ending in flight
    # and a waiting prompt admitted into the blocks it freed.
    prompts = mixed_prompts(7, hi=20, seed=3)
    lens = [3, 11, 1, 7, 14, 5, 9]
    launched = _launched(monkeypatch)
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in lens])
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(llama_dir, p, n) for p, n in zip(prompts, lens, strict=True)]
    assert [o.outputs[0].finish_reason for o in outs] == ["length"] * 7
    assert len(launched) > 5  # steps really ran in flight (a bucket's first step, its capture, waits)
    assert llm.engine.block_manager.num_free_blocks == llm.engine.config.num_blocks  # every block back
    assert not llm.engine.has_unfinished()


def test_a_stop_token_ends_a_sequence_that_the_next_step_was_already_fed(llm: LLM, llama_dir: Path) -> None:
    prompts = mixed_prompts(5, hi=20, seed=4)
    refs = [hf_greedy(llama_dir, p, 12) for p in prompts]
    # each prompt's stop token: its 3rd greedy token (the output then ends at that token's first occurrence)
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[r[2]]) for r in refs]
    outs = llm.generate(prompts, params)
    for o, r in zip(outs, refs, strict=True):
        end = r.index(r[2]) + 1
        assert o.outputs[0].token_ids == r[:end]
        assert (o.outputs[0].finish_reason, o.outputs[0].stop_reason) == ("stop", r[2])
    assert llm.engine.block_manager.num_free_blocks == llm.engine.config.num_blocks


def test_preemption_while_a_step_is_in_flight(llama_dir: Path) -> None:
    # 9 blocks of 4 tokens for 3 sequences that each grow to ~30: the pool runs out while steps are in flight
    llm = _llm(llama_dir, num_blocks=9)
    prompts = mixed_prompts(4, lo=8, hi=14, seed=5)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=18))
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(llama_dir, p, 18) for p in prompts]
    assert llm.engine.block_manager.num_free_blocks == 9


def test_an_abort_while_its_step_is_in_flight(llm: LLM, llama_dir: Path) -> None:
    eng = llm.engine
    prompts = mixed_prompts(2, hi=20, seed=6)
    params = SamplingParams(temperature=0, max_tokens=10)
    for i, p in enumerate(prompts):
        eng.add_request(f"abort-{i}", p, params)
    tokens: dict[str, list[int]] = {"abort-0": [], "abort-1": []}
    aborted_at = None
    while eng.has_unfinished():
        for u in eng.step():
            tokens[u.request_id] += u.new_token_ids
        if aborted_at is None and len(tokens["abort-0"]) >= 3:
            assert eng._inflight is not None  # a step that computes abort-0 is running now
            eng.abort_request("abort-0")
            aborted_at = len(tokens["abort-0"])
    assert len(tokens["abort-0"]) == aborted_at  # nothing after the abort
    assert tokens["abort-0"] == hf_greedy(llama_dir, prompts[0], 10)[:aborted_at]
    assert tokens["abort-1"] == hf_greedy(llama_dir, prompts[1], 10)
    assert eng.block_manager.num_free_blocks == eng.config.num_blocks


def test_seeded_sampling_and_logprobs_as_without_it(llm: LLM, llama_dir: Path) -> None:
    """Sampling reads each sequence's tokens before the next is drawn, in the same order: a seeded request
    draws what it draws with async scheduling off (where the seeded sampler is tested against its distribution)."""
    prompts = mixed_prompts(3, hi=20, seed=7)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=11 + i, n=2, max_tokens=9, logprobs=2,
                             presence_penalty=0.5) for i in range(3)]
    sync = _llm(llama_dir, async_scheduling=False)
    assert not sync.engine.async_scheduling
    got, want = llm.generate(prompts, params), sync.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        assert [c.token_ids for c in g.outputs] == [c.token_ids for c in w.outputs]
        for cg, cw in zip(g.outputs, w.outputs, strict=True):
            assert [d["token"] for d in cg.logprobs] == [d["token"] for d in cw.logprobs]
            assert [d["logprob"] for d in cg.logprobs] == pytest.approx([d["logprob"] for d in cw.logprobs], abs=1e-5)


def test_the_openai_server_on_the_device_streams_what_the_cpu_engine_writes(llama_dir: Path) -> None:
    """`serve --device <bridge>` (the engine in its own process, async scheduling its default there) through the
    official client: concurrent streams, a stop string that ends a sequence already fed to the next step."""
    import concurrent.futures

    import openai
    from serve_support import API_KEY, running_server

    from torchbridge.serve.engine_process import EngineProcess
    from torchbridge.serve.server import create_app

    prompts = ["the cat sat on", "a b c d e", "one two three four five six"]
    ref = LLM(str(llama_dir), block_size=4, num_blocks=64, max_model_len=48).generate(
        prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    texts = [o.outputs[0].text for o in ref]
    stop = texts[0][len(texts[0]) // 2 : len(texts[0]) // 2 + 3]  # ends the first prompt's output midway
    config = EngineConfig(model=str(llama_dir), device=DEV, block_size=4, num_blocks=64, max_model_len=48,
                          served_model_name="tiny")
    assert config.async_scheduling
    engine = EngineProcess(config)
    engine.start()
    try:
        with running_server(create_app(engine, api_key=API_KEY, max_request_bytes=2**20)) as url:
            client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)

            def stream(i: int) -> tuple[str, str | None]:
                chunks = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=14,
                                                   temperature=0, stream=True, stop=[stop] if i == 0 else None,
                                                   extra_body={"ignore_eos": True})
                text, reason = "", None
                for c in chunks:
                    text += c.choices[0].text
                    reason = c.choices[0].finish_reason or reason
                return text, reason

            with concurrent.futures.ThreadPoolExecutor(3) as pool:
                got = list(pool.map(stream, range(3)))
    finally:
        engine.shutdown()
    assert got[0] == (texts[0][: texts[0].find(stop)], "stop")
    assert got[1:] == [(t, "length") for t in texts[1:]]
