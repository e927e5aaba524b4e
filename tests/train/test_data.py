"""The data recipe: batches are a function of (seed, step) that data-parallel ranks split without gaps or
overlap, and the tool-call conversations render in the Hermes format the engine's parser reads back."""

from __future__ import annotations

import json
import random

import torch

from torchbridge.serve.tool_parser import HermesToolParser
from torchbridge.train import data


def test_global_batch_depends_only_on_seed_and_step():
    stream = torch.arange(10_000, dtype=torch.int32)
    a = data.global_batch(stream, 16, 8, seed=3, step=5)
    assert torch.equal(a, data.global_batch(stream, 16, 8, seed=3, step=5))
    assert not torch.equal(a, data.global_batch(stream, 16, 8, seed=3, step=6))
    assert a.shape == (8, 17) and torch.equal(a[:, 1:] - a[:, :-1], torch.ones(8, 16, dtype=torch.long))


def test_data_parallel_ranks_split_each_micro_batch_exactly():
    batch = torch.arange(12 * 5).view(12, 5)
    for accum, dp in ((1, 4), (3, 2), (2, 3)):
        parts = [data.local_micro_batches(batch, accum, dp, r) for r in range(dp)]
        rebuilt = torch.cat([parts[r][m] for m in range(accum) for r in range(dp)])
        assert torch.equal(rebuilt, batch), (accum, dp)


def test_tool_call_conversation_renders_hermes_calls_the_engine_parses(tmp_path):
    docs = data.read_split("train", 300_000)
    tokenizer = data.train_tokenizer([t for _, t in docs], 400)
    rng = random.Random(0)
    functions = [f for f in data.documented_functions(docs, rng) if f.params][:4]
    messages, tools = data.tool_call_chat(functions[0], functions[1:], rng)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
    assert text.startswith("<|im_start|>system\n# Tools") and "<tools>" in text
    assert {json.loads(line)["function"]["name"] for line in text.split("<tools>\n")[1].split("\n</tools>")[0]
            .splitlines()} == {f.name for f in functions}
    reply = text.split("<|im_start|>assistant\n")[1].split("<|im_end|>")[0]
    parser = HermesToolParser()
    content, calls = parser.feed(reply)
    assert content.strip() == "" and len(calls) == 1, (content, calls)
    call = calls[0]["function"]
    assert call["name"] == functions[0].name
    assert json.loads(call["arguments"]) == messages[1]["tool_calls"][0]["function"]["arguments"]
    assert "<tool_response>" in text
