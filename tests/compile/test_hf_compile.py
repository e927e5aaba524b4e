"""Hugging Face models compiled with torch.compile(backend="tpu") against the same models on CPU eager.

CI runs a representative subset (decoder, mixture-of-experts, encoder, encoder-decoder forward; static-cache greedy
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
# qwen3_moe: transformers picks torch._grouped_mm for our device in float32 (the FakeTensor rule in
# lowerings/extra.py makes it traceable); about 3 s.
FAST_FORWARD = {"llama", "gpt2", "bert", "t5", "qwen3_moe"}
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


@pytest.mark.parametrize("layout", ["2d_3d", "2d_2d", "3d_2d", "3d_3d"])
def test_compiled_float32_grouped_mm_matches_cpu(layout: str) -> None:
    # What the MoE experts reach: torch._grouped_mm in float32 (PyTorch's meta kernel is bfloat16-only),
    # traced through our FakeTensor rule and run by the lowering, forward and backward.
    g = torch.Generator().manual_seed(0)
    offs = torch.tensor([3, 3, 7], dtype=torch.int32)  # an empty group; rows past offs[-1] are undefined
    a, b = {
        "2d_3d": lambda: (torch.randn(8, 4, generator=g), torch.randn(3, 4, 8, generator=g)),
        "2d_2d": lambda: (torch.randn(8, 4, generator=g).T, torch.randn(8, 4, generator=g)),
        "3d_2d": lambda: (torch.randn(3, 4, 8, generator=g), torch.randn(8, 8, generator=g).T),
        "3d_3d": lambda: (torch.randn(3, 4, 8, generator=g), torch.randn(3, 8, 4, generator=g)),
    }[layout]()
    o = None if layout == "3d_3d" else offs
    rows, cols = (slice(0, 7),), (slice(None), slice(0, 7))
    keep = {"2d_3d": rows, "3d_2d": cols}.get(layout, ())
    keep_grad_a = {"2d_3d": rows, "2d_2d": cols}.get(layout, ())  # CPU leaves the rest unwritten
    keep_grad_b = {"2d_2d": rows, "3d_2d": cols}.get(layout, ())

    def f(a: torch.Tensor, b: torch.Tensor, o: torch.Tensor | None) -> torch.Tensor:
        return torch._grouped_mm(a, b, offs=o)[keep]

    ac, bc = a.clone().requires_grad_(), b.clone().requires_grad_()
    ref = f(ac, bc, o)
    (ref**2).sum().backward()
    ad, bd = a.to(DEV).requires_grad_(), b.to(DEV).requires_grad_()
    out = torch.compile(f, backend="tpu", fullgraph=True)(ad, bd, None if o is None else o.to(DEV))
    (out**2).sum().backward()
    torch.testing.assert_close(out.detach().cpu(), ref.detach(), atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(ad.grad.cpu()[keep_grad_a], ac.grad[keep_grad_a], atol=ATOL, rtol=1e-4)
    torch.testing.assert_close(bd.grad.cpu()[keep_grad_b], bc.grad[keep_grad_b], atol=ATOL, rtol=1e-4)
