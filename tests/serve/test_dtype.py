"""Half-precision serving (--dtype bfloat16 / float16): the engine's log-probabilities stay within the
error Hugging Face's own model shows in that dtype against its float32 run, on the same prefixes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from serve_support import hf_greedy, hf_model, mixed_prompts

from torchbridge.serve import LLM, SamplingParams

TOP = 20


def _errors(lp32: torch.Tensor, lp16: torch.Tensor, ours: dict[int, float]) -> tuple[float, float]:
    """At one position: HF's half-precision error and ours, both against HF's float32 log-probabilities.
    The engine reports its own top tokens; compare on the float32 top tokens both runs report."""
    common = [t for t in lp32.topk(TOP).indices.tolist() if t in ours]
    assert len(common) >= TOP - 3
    return (max(abs(float(lp16[t] - lp32[t])) for t in common),
            max(abs(ours[t] - float(lp32[t])) for t in common))


def _assert_within_hf_error(hf_err: list[float], our_err: list[float]) -> None:
    hf_max, ours_max = max(hf_err), max(our_err)
    hf_mean, ours_mean = sum(hf_err) / len(hf_err), sum(our_err) / len(our_err)
    assert hf_max > 1e-4, "the half-precision model should differ measurably from float32"
    # Within HF's own error (a factor 2 of slack: accumulation order differs between implementations).
    assert ours_max <= 2 * hf_max and ours_mean <= 2 * hf_mean, (ours_max, hf_max, ours_mean, hf_mean)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_within_hf_own_error(llama_dir: Path, dtype: str) -> None:
    from transformers import AutoModelForCausalLM

    torch_dtype = getattr(torch, dtype)
    # Prefixes: prompts and the float32 greedy continuations (teacher forcing: both runs see the same ids).
    prefixes = []
    for p in mixed_prompts(4, seed=9, lo=5, hi=30):
        cont = hf_greedy(llama_dir, p, 6)
        prefixes += [p + cont[:i] for i in (0, 3, 6)]
    ref32 = hf_model(str(llama_dir))
    ref16 = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch_dtype).eval()
    llm = LLM(str(llama_dir), dtype=dtype, block_size=4, num_blocks=128, max_model_len=96)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch_dtype
    outs = llm.generate(prefixes, SamplingParams(temperature=0, max_tokens=1, logprobs=TOP))
    hf_err, our_err = [], []
    for ids, out in zip(prefixes, outs, strict=True):
        with torch.no_grad():
            lp32 = torch.log_softmax(ref32(torch.tensor([ids])).logits[0, -1].double(), -1)
            lp16 = torch.log_softmax(ref16(torch.tensor([ids])).logits[0, -1].double(), -1)
        hf, ours = _errors(lp32, lp16, dict(out.outputs[0].logprobs[0]["top"]))
        hf_err.append(hf)
        our_err.append(ours)
    _assert_within_hf_error(hf_err, our_err)


@pytest.mark.parametrize("dtype,device", [("bfloat16", "cpu"), ("float16", "cpu"), ("bfloat16", "tpu")])
def test_half_precision_decode_steps_within_hf_own_error(llama_dir: Path, dtype: str, device: str) -> None:
    """Decode steps (a few rows per linear: on a CPU with AMX, bf16 runs them through the AMX kernel),
    checked the same way: our own greedy continuation, teacher-forced through Hugging Face in float32 and
    in `dtype`, and the engine's log-probabilities at every generated position against float32. On the
    bridge's device the step is compiled and its bf16 KV cache is uint16 storage moved as bits."""
    from transformers import AutoModelForCausalLM

    from torchbridge.serve.linear import Linear

    torch_dtype = getattr(torch, dtype)
    prompts = mixed_prompts(4, seed=11, lo=5, hi=30)
    llm = LLM(str(llama_dir), dtype=dtype, block_size=4, num_blocks=128, max_model_len=96, device=device)
    runner = llm.engine.runner
    if device != "cpu":
        assert runner.kv_caches[0][0].untyped_storage().nbytes() == runner.kv_caches[0][0].numel() * 2
    if dtype == "bfloat16" and runner.decode_kernel:
        from torchbridge.serve import cpu_kernels

        tiled = [m.tiles is not None for m in runner.model.modules() if isinstance(m, Linear)]
        assert all(tiled) if cpu_kernels.tile_kernel() else not any(tiled)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, logprobs=TOP))
    ref32 = hf_model(str(llama_dir))
    ref16 = AutoModelForCausalLM.from_pretrained(str(llama_dir), dtype=torch_dtype).eval()
    hf_err, our_err = [], []
    for p, out in zip(prompts, outs, strict=True):
        ids = p + list(out.outputs[0].token_ids)
        with torch.no_grad():
            lp32 = torch.log_softmax(ref32(torch.tensor([ids])).logits[0].double(), -1)
            lp16 = torch.log_softmax(ref16(torch.tensor([ids])).logits[0].double(), -1)
        for i, step in enumerate(out.outputs[0].logprobs[1:], start=1):  # positions a decode step computed
            pos = len(p) + i - 1
            hf, ours = _errors(lp32[pos], lp16[pos], dict(step["top"]))
            hf_err.append(hf)
            our_err.append(ours)
    assert len(our_err) == 4 * 7
    _assert_within_hf_error(hf_err, our_err)
