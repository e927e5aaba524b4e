"""Unmodified Hugging Face Transformers models on the device, checked against the same model on CPU.

Each family gets a tiny random-init config (hidden 32, 2 layers, vocab 128, float32). The CPU model is
built with a fixed seed and a deep copy of it is moved to the device, so both start from identical
weights; the CPU run is the independent reference for logits, greedy generation and gradients.
Shapes are shared across families on purpose: compiled device programs are cached by shape, which
keeps the whole file affordable on a small CPU host.
"""

from __future__ import annotations

import copy

import pytest
import torch

from hf_families import FAMILIES, VOCAB, build, inputs, to

torchbridge = pytest.importorskip("torchbridge")

if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

DEV = torchbridge.device_name()
ATOL = 1e-4
assert VOCAB == 128  # the shapes below are shared with the compiled-model tests on purpose

_pairs: dict[tuple[str, str], tuple[torch.nn.Module, torch.nn.Module]] = {}


def _pair(name: str, attn: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(cpu model, device copy) with identical weights, built once per (family, attention)."""
    key = (name, attn)
    if key not in _pairs:
        cpu = build(name, attn)
        _pairs[key] = (cpu, copy.deepcopy(cpu).to(DEV))
    return _pairs[key]


def _params(name: str) -> list[tuple[str, str]]:
    cases = [(name, "eager")]
    if FAMILIES[name].sdpa:
        cases.append((name, "sdpa"))
    return cases


FORWARD_CASES = [c for n in FAMILIES for c in _params(n)]


@pytest.mark.parametrize(("name", "attn"), FORWARD_CASES, ids=[f"{n}-{a}" for n, a in FORWARD_CASES])
def test_forward_logits_match_cpu(name: str, attn: str) -> None:
    cpu, dev = _pair(name, attn)
    batch = inputs(name)
    with torch.no_grad():
        ref = cpu(**batch).logits
        out = dev(**to(batch, DEV)).logits
    assert out.device.type == DEV
    torch.testing.assert_close(out.cpu(), ref, atol=ATOL, rtol=0)


GENERATE_CASES = [n for n in FAMILIES if FAMILIES[n].generate]


@pytest.mark.parametrize("name", GENERATE_CASES)
def test_greedy_generate_matches_cpu(name: str) -> None:
    cpu, dev = _pair(name, "eager")
    batch = inputs(name)
    batch.pop("decoder_input_ids", None)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = cpu.generate(**batch, **kw)
        out = dev.generate(**to(batch, DEV), **kw)
    assert out.device.type == DEV
    # Decoder-only outputs continue the prompt; seq2seq outputs start from the decoder start token.
    prompt = 1 if FAMILIES[name].auto == "seq2seq" else batch["input_ids"].shape[1]
    assert ref.shape[1] > prompt + 1
    assert torch.equal(out.cpu(), ref), f"{out.cpu()} != {ref}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_backward_matches_cpu(name: str) -> None:
    # Separate models: the forward-test pair must keep its weights and carry no gradients.
    cpu = build(name, "eager", train=True)
    dev = copy.deepcopy(cpu).to(DEV)
    batch = inputs(name)
    labels = batch.get("decoder_input_ids", batch["input_ids"])
    ref_loss = cpu(**batch, labels=labels).loss
    ref_loss.backward()
    loss = dev(**to(batch, DEV), labels=labels.to(DEV)).loss
    loss.backward()
    torch.testing.assert_close(loss.detach().cpu(), ref_loss.detach(), atol=ATOL, rtol=0)
    compared = 0
    for (pname, p_cpu), (_, p_dev) in zip(cpu.named_parameters(), dev.named_parameters(), strict=True):
        if p_cpu.grad is None:
            assert p_dev.grad is None, pname
            continue
        assert p_dev.grad is not None and p_dev.grad.device.type == DEV, pname
        torch.testing.assert_close(p_dev.grad.cpu(), p_cpu.grad, atol=ATOL, rtol=0, msg=lambda m, n=pname: f"{n}: {m}")
        compared += 1
    assert compared >= 4
