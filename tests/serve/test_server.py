"""The HTTP server through the official `openai` client (and httpx for what the client cannot send)."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
from serve_support import API_KEY, hf_greedy, hf_logits

MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def client(server: tuple) -> openai.OpenAI:
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def chat_prompt_ids(llama_dir: Path, messages: list[dict]) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(llama_dir))
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def hf_text(llama_dir: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama_dir)).decode(ids, skip_special_tokens=True)


def test_models(client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_matches_hf(client: openai.OpenAI, llama_dir: Path) -> None:
    from transformers import AutoTokenizer

    prompt = "The quick brown fox"
    ids = AutoTokenizer.from_pretrained(str(llama_dir)).encode(prompt)
    expected = hf_greedy(llama_dir, ids, 10)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0)
    assert r.choices[0].text == hf_text(llama_dir, expected)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(expected)
    assert r.choices[0].finish_reason == ("stop" if expected[-1] == 1 else "length")


def test_completion_with_several_prompts(client: openai.OpenAI, llama_dir: Path) -> None:
    prompts = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46], [9]]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [hf_text(llama_dir, hf_greedy(llama_dir, p, 6)) for p in prompts]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[[5, 6], [7] * 600], max_tokens=2)


def test_completion_streaming_with_usage(client: openai.OpenAI, llama_dir: Path) -> None:
    full = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text == hf_text(llama_dir, hf_greedy(llama_dir, [5, 6, 7, 8], 12))
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason


def test_chat_matches_hf_and_streams(client: openai.OpenAI, llama_dir: Path) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "Hello world!"}]
    ids = chat_prompt_ids(llama_dir, messages)
    expected = hf_text(llama_dir, hf_greedy(llama_dir, ids, 9))
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == len(ids)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens


def test_seed_reproducible_and_n(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL, prompt="Hello", max_tokens=12, temperature=1.0, seed=42, n=2,
              extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices] and len(a.choices) == 2
    c = client.completions.create(**{**kw, "seed": 43})
    assert [x.text for x in c.choices] != [x.text for x in a.choices]


def test_chat_logprobs_match_hf(client: openai.OpenAI, llama_dir: Path) -> None:
    messages = [{"role": "user", "content": "count: one two"}]
    ids = chat_prompt_ids(llama_dir, messages)
    out = hf_greedy(llama_dir, ids, 5)
    ref = torch.log_softmax(hf_logits(llama_dir, ids + out), dim=-1)[len(ids) - 1 : -1]
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == len(out)
    for i, item in enumerate(content):
        assert abs(item.logprob - float(ref[i, out[i]])) < 1e-4
        assert len(item.top_logprobs) == 2 and abs(item.top_logprobs[0].logprob - float(ref[i].max())) < 1e-4


def test_completion_logprobs(client: openai.OpenAI, llama_dir: Path) -> None:
    prompt = [30, 31, 32, 33]
    out = hf_greedy(llama_dir, prompt, 4)
    ref = torch.log_softmax(hf_logits(llama_dir, prompt + out), dim=-1)[len(prompt) - 1 : -1]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(out) and len(lp.top_logprobs[0]) <= 3
    for i, v in enumerate(lp.token_logprobs):
        assert abs(v - float(ref[i, out[i]])) < 1e-4


def _error_of(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body["error"]) >= {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"extra_body": {"top_k": -5}}, "top_k"),
        ({"presence_penalty": 7}, "presence_penalty"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_bad_sampling_params_are_400(client: openai.OpenAI, kwargs: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="hi", **kwargs)
    assert _error_of(e.value)["param"] == param


def test_bad_requests(client: openai.OpenAI, server: tuple) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="no-such-model", prompt="hi")
    assert _error_of(e.value)["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=[])
    assert _error_of(e.value)["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[5] * 600)  # longer than max_model_len 512
    assert "context length" in _error_of(e.value)["message"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt="")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server[0] + "/v1", api_key="wrong", max_retries=0).models.list()
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    for body in (b"{not json", b"[1, 2]", b'{"model": "tiny-llama"}'):
        r = httpx.post(server[0] + "/v1/chat/completions", content=body, headers=headers)
        assert r.status_code == 400 and set(r.json()["error"]) >= {"message", "type", "param", "code"}
    # Still serving after all of that.
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices


def test_metrics_and_health(client: openai.OpenAI, server: tuple) -> None:
    base = server[0]
    assert httpx.get(base + "/health").status_code == 200
    client.completions.create(model=MODEL, prompt=[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], max_tokens=6, temperature=0)
    # every token id in the prompt: whatever the model generates was seen before, so the n-gram
    # proposer (1-gram matches and up) drafts at the first decode step, whatever ran before this test
    client.completions.create(model=MODEL, prompt=list(range(320)), max_tokens=6, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(base + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                 "vllm:spec_decode_num_accepted_tokens_total", "vllm:spec_decode_num_draft_tokens_total"):
        assert name in text, name
    assert 'vllm:cache_config_info{block_size="4",enable_prefix_caching="True",num_gpu_blocks="256"} 1.0' in text
    from prometheus_client.parser import text_string_to_metric_families

    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert values["vllm:generation_tokens_total"] >= 6 and values["vllm:prompt_tokens_total"] >= 10
    assert values["vllm:spec_decode_num_draft_tokens_total"] > 0
    per_pos = [s for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"]
    assert per_pos and sum(s.value for s in per_pos) == values["vllm:spec_decode_num_accepted_tokens_total"]


def test_iteration_tokens_count_steps_and_tokens(client: openai.OpenAI, server: tuple) -> None:
    """vLLM's vllm:iteration_tokens_total: one observation per engine step, summing the prompt tokens the
    step computed and the tokens it generated; checked against the request's own usage."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples() -> dict[str, float]:
        text = httpx.get(server[0] + "/metrics").text
        return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name.startswith("vllm:iteration_tokens_total")}

    before = samples()
    prompt = [29, 3, 57, 41, 18, 62, 5, 33, 47, 12, 54, 26, 9, 38]  # not seen before: no prefix-cache hit
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    after = samples()
    steps = after["vllm:iteration_tokens_total_count"] - before.get("vllm:iteration_tokens_total_count", 0)
    tokens = after["vllm:iteration_tokens_total_sum"] - before.get("vllm:iteration_tokens_total_sum", 0)
    assert tokens == out.usage.prompt_tokens + out.usage.completion_tokens == len(prompt) + 5
    # at least one step for the prompt; no more steps than tokens (speculation may add several per step)
    assert 1 <= steps <= out.usage.completion_tokens + len(prompt)


def test_kv_events_publish_prompt_blocks(client: openai.OpenAI, server: tuple) -> None:
    import xxhash

    base, headers = server[0], {"Authorization": f"Bearer {API_KEY}"}
    start = httpx.get(base + "/v1/kv_events", params={"since": 10**9}, headers=headers).json()["next"]
    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks of 4
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    events = httpx.get(base + "/v1/kv_events", params={"since": start}, headers=headers).json()
    stored = [h for e in events["events"] if e["type"] == "stored" for h in e["block_hashes"]]
    parent, expected = 0, []
    for i in range(3):  # independent recomputation of the documented hash chain
        data = parent.to_bytes(8, "little") + b"".join(t.to_bytes(4, "little") for t in prompt[4 * i : 4 * i + 4])
        parent = xxhash.xxh64_intdigest(data)
        expected.append(parent)
    assert stored[:3] == expected and events["block_size"] == 4


def _metric_sums(base: str) -> dict[str, float]:
    """Each metric's samples summed over their labels, as the server exports them."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for f in text_string_to_metric_families(httpx.get(base + "/metrics").text):
        for s in f.samples:
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    return sums


def test_client_disconnect_aborts_request(server: tuple) -> None:
    """Read through /metrics, so it holds wherever the engine runs (its own process by default)."""
    base = server[0]
    headers = {"Authorization": f"Bearer {API_KEY}"}
    busy = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")
    finished_before = _metric_sums(base).get("vllm:request_success_total", 0.0)
    # 500 tokens take far longer than noticing a closed connection, so finishing first is not a race.
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 500, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", base + "/v1/completions", json=body, headers=headers, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                break
    deadline = time.monotonic() + 20
    while any(_metric_sums(base)[k] for k in busy) and time.monotonic() < deadline:
        time.sleep(0.05)
    after = _metric_sums(base)
    assert [after[k] for k in busy] == [0, 0, 0]
    # It was aborted, not run to its end.
    assert after.get("vllm:request_success_total", 0.0) == finished_before


def test_logit_bias_matches_hf_sequence_bias(client: openai.OpenAI, llama_dir: Path) -> None:
    """OpenAI's logit_bias against Hugging Face's own bias processor (single-token sequence_bias)."""
    prompt = [30, 31, 32, 33]
    plain = hf_greedy(llama_dir, prompt, 6)
    bias = {plain[0]: -100.0, plain[1]: 4.0, 77: 2.5}
    model = __import__("serve_support").hf_model(str(llama_dir))
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, 4, dtype=torch.long), do_sample=False,
                             max_new_tokens=6, sequence_bias={(t,): v for t, v in bias.items()})
    expected = out[0, 4:].tolist()
    assert expected != plain
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                                  logit_bias={str(t): v for t, v in bias.items()})
    assert r.choices[0].text == hf_text(llama_dir, expected)
