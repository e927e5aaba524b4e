"""Unmodified Hugging Face Transformers models on the device, checked against the same model on CPU.

Each family gets a tiny random-init config (hidden 32, 2 layers, vocab 128, float32). The CPU model is
built with a fixed seed and a deep copy of it is moved to the device, so both start from identical
weights; the CPU run is the independent reference for logits, greedy generation and gradients.
Shapes are shared across families on purpose: compiled device programs are cached by shape, which
keeps the whole file affordable on a small CPU host.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

transformers = pytest.importorskip("transformers")
torchbridge = pytest.importorskip("torchbridge")

if torchbridge.registration_error() is not None:  # pragma: no cover - depends on the host
    pytest.skip(f"device backend unavailable: {torchbridge.registration_error()}", allow_module_level=True)

DEV = torchbridge.device_name()
VOCAB = 128
HIDDEN = 32
ATOL = 1e-4


def _decoder(cls: Callable[..., object], **extra: object) -> Callable[[], object]:
    def make() -> object:
        kw: dict[str, object] = dict(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
        kw.update(extra)
        return cls(**kw)

    return make


@dataclass(frozen=True)
class Family:
    config: Callable[[], object]
    auto: str = "causal"  # causal | masked | seq2seq
    sdpa: bool = True  # the family implements the sdpa attention path
    generate: bool = True  # encoder-only models have no generate()


FAMILIES: dict[str, Family] = {
    "llama": Family(_decoder(transformers.LlamaConfig)),
    "qwen2": Family(_decoder(transformers.Qwen2Config)),
    "qwen3": Family(_decoder(transformers.Qwen3Config, head_dim=8)),
    "qwen3_moe": Family(_decoder(transformers.Qwen3MoeConfig, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True)),
    "mistral": Family(_decoder(transformers.MistralConfig, head_dim=8)),
    "gemma": Family(_decoder(transformers.GemmaConfig, head_dim=8)),
    "phi3": Family(_decoder(transformers.Phi3Config)),
    "gpt2": Family(lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "gpt_neox": Family(lambda: transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "opt": Family(lambda: transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, word_embed_proj_dim=HIDDEN, dropout=0.0, attention_dropout=0.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)),
    "bert": Family(lambda: transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0),
        auto="masked", generate=False),
    "t5": Family(lambda: transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, pad_token_id=0, eos_token_id=2, decoder_start_token_id=0),
        auto="seq2seq"),
}

_AUTO = {
    "causal": transformers.AutoModelForCausalLM,
    "masked": transformers.AutoModelForMaskedLM,
    "seq2seq": transformers.AutoModelForSeq2SeqLM,
}

_pairs: dict[tuple[str, str], tuple[torch.nn.Module, torch.nn.Module]] = {}


def _pair(name: str, attn: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(cpu model, device copy) with identical weights, built once per (family, attention)."""
    key = (name, attn)
    if key not in _pairs:
        fam = FAMILIES[name]
        torch.manual_seed(0)
        cpu = _AUTO[fam.auto].from_config(fam.config(), attn_implementation=attn).eval()
        dev = copy.deepcopy(cpu).to(DEV)
        _pairs[key] = (cpu, dev)
    return _pairs[key]


def _inputs(name: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 7), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if FAMILIES[name].auto == "seq2seq":
        batch["decoder_input_ids"] = torch.randint(3, VOCAB, (2, 5), generator=g)
    return batch


def _to(batch: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}


def _params(name: str) -> list[tuple[str, str]]:
    cases = [(name, "eager")]
    if FAMILIES[name].sdpa:
        cases.append((name, "sdpa"))
    return cases


FORWARD_CASES = [c for n in FAMILIES for c in _params(n)]


@pytest.mark.parametrize(("name", "attn"), FORWARD_CASES, ids=[f"{n}-{a}" for n, a in FORWARD_CASES])
def test_forward_logits_match_cpu(name: str, attn: str) -> None:
    cpu, dev = _pair(name, attn)
    batch = _inputs(name)
    with torch.no_grad():
        ref = cpu(**batch).logits
        out = dev(**_to(batch, DEV)).logits
    assert out.device.type == DEV
    torch.testing.assert_close(out.cpu(), ref, atol=ATOL, rtol=0)


GENERATE_CASES = [n for n in FAMILIES if FAMILIES[n].generate]


@pytest.mark.parametrize("name", GENERATE_CASES)
def test_greedy_generate_matches_cpu(name: str) -> None:
    cpu, dev = _pair(name, "eager")
    batch = _inputs(name)
    batch.pop("decoder_input_ids", None)
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = cpu.generate(**batch, **kw)
        out = dev.generate(**_to(batch, DEV), **kw)
    assert out.device.type == DEV
    # Decoder-only outputs continue the prompt; seq2seq outputs start from the decoder start token.
    prompt = 1 if FAMILIES[name].auto == "seq2seq" else batch["input_ids"].shape[1]
    assert ref.shape[1] > prompt + 1
    assert torch.equal(out.cpu(), ref), f"{out.cpu()} != {ref}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_backward_matches_cpu(name: str) -> None:
    # Separate models: the forward-test pair must keep its weights and carry no gradients.
    fam = FAMILIES[name]
    torch.manual_seed(0)
    cpu = _AUTO[fam.auto].from_config(fam.config(), attn_implementation="eager").train()
    dev = copy.deepcopy(cpu).to(DEV)
    batch = _inputs(name)
    labels = batch.get("decoder_input_ids", batch["input_ids"])
    ref_loss = cpu(**batch, labels=labels).loss
    ref_loss.backward()
    loss = dev(**_to(batch, DEV), labels=labels.to(DEV)).loss
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
