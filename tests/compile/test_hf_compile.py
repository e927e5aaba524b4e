"""Hugging Face models compiled with torch.compile(backend="tpu") against the same models on CPU eager.

CI runs a representative subset (decoder, encoder, encoder-decoder forward; static-cache greedy
generation for Llama); TB_SLOW=1 (make test-all) runs every family of the eager model tests.
"""

from __future__ import annotations

import os

import pytest
import torch
from transformers import CompileConfig

import torchbridge
from hf_families import FAMILIES, inputs, pair, to

DEV = torchbridge.device_name()
ATOL = 1e-4
FAST_FORWARD = {"llama", "gpt2", "bert", "t5"}
FAST_GENERATE = {"llama"}
SLOW = os.environ.get("TB_SLOW") == "1"


def _maybe_slow(name: str, fast: set[str]):
    return pytest.param(name, marks=[] if name in fast or SLOW else [pytest.mark.skip(
        reason="heavy: compiles a new model; runs with TB_SLOW=1 (make test-all)")])


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", [_maybe_slow(n, FAST_FORWARD) for n in FAMILIES])
def test_compiled_forward_logits_match_cpu(name: str) -> None:
    cpu, dev = pair(name, DEV)
    batch = inputs(name)
    compiled = torch.compile(dev, backend="tpu")
    with torch.no_grad():
        ref = cpu(**batch).logits
        out = compiled(**to(batch, DEV)).logits
    torch.testing.assert_close(out.cpu(), ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("name", [_maybe_slow(n, FAST_GENERATE) for n in FAMILIES if FAMILIES[n].static_cache])
def test_static_cache_compiled_generate_gives_cpu_greedy_tokens(name: str) -> None:
    # HF compiles the decode step itself when the cache is static; we point it at our backend.
    cpu, dev = pair(name, DEV)
    batch = inputs(name)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = cpu.generate(**batch, **kw)
        out = dev.generate(**to(batch, DEV), cache_implementation="static",
                           compile_config=CompileConfig(backend="tpu", mode=None, fullgraph=False), **kw)
    assert ref.shape[1] == batch["input_ids"].shape[1] + 6
    assert torch.equal(out.cpu(), ref), f"{out.cpu()} != {ref}"
