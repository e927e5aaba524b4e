"""The engine on the bridge's `tpu` device: the same greedy tokens as Hugging Face on CPU, and no
XLA recompiles once the shape buckets are warm (counted by the bridge's compile counter)."""

from __future__ import annotations

from pathlib import Path

import pytest
from serve_support import hf_greedy, mixed_prompts

from torchbridge.serve import LLM, SamplingParams

torchbridge = pytest.importorskip("torchbridge")
if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

DEV = torchbridge.device_name()
MAX_NEW = 8


@pytest.fixture(scope="module")
def device_llm(llama_dir: Path) -> LLM:
    llm = LLM(str(llama_dir), device=DEV, block_size=4, num_blocks=96, max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32)
    assert llm.engine.runner.warmup(4, 32, progress=False) > 0
    return llm


def test_greedy_on_device_matches_hf_generate_on_cpu(device_llm: LLM, llama_dir: Path) -> None:
    prompts = mixed_prompts(3, hi=24)
    outs = device_llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(llama_dir, p, MAX_NEW) for p in prompts]


def test_steady_state_serving_does_not_recompile(device_llm: LLM, llama_dir: Path) -> None:
    prompts = mixed_prompts(3, hi=24)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    device_llm.generate(prompts, params)  # any shape not covered by warm-up is compiled here, once
    before = torchbridge.metrics()["compiles"]
    outs = device_llm.generate(prompts, params)
    assert torchbridge.metrics()["compiles"] == before
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(llama_dir, p, MAX_NEW) for p in prompts]
