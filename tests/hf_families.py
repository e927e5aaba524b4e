"""Tiny random-init Hugging Face configs for the model families the bridge is tested on.

Shared by the eager (tests/device) and compiled (tests/compile) model tests. Each family gets a tiny
float32 config (hidden 32, 2 layers, vocab 128); a CPU model built with a fixed seed and a deep
copy moved to the device start from identical weights, so the CPU run is the independent reference.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

import torch
import transformers

VOCAB = 128
HIDDEN = 32


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
    static_cache: bool = False  # generate() with cache_implementation="static" is supported


FAMILIES: dict[str, Family] = {
    "llama": Family(_decoder(transformers.LlamaConfig), static_cache=True),
    "qwen2": Family(_decoder(transformers.Qwen2Config), static_cache=True),
    "qwen3": Family(_decoder(transformers.Qwen3Config, head_dim=8), static_cache=True),
    "qwen3_moe": Family(_decoder(transformers.Qwen3MoeConfig, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                 moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True)),
    "mistral": Family(_decoder(transformers.MistralConfig, head_dim=8), static_cache=True),
    "gemma": Family(_decoder(transformers.GemmaConfig, head_dim=8), static_cache=True),
    "phi3": Family(_decoder(transformers.Phi3Config), static_cache=True),
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

AUTO = {
    "causal": transformers.AutoModelForCausalLM,
    "masked": transformers.AutoModelForMaskedLM,
    "seq2seq": transformers.AutoModelForSeq2SeqLM,
}


def build(name: str, attn: str = "eager", train: bool = False) -> torch.nn.Module:
    fam = FAMILIES[name]
    torch.manual_seed(0)
    model = AUTO[fam.auto].from_config(fam.config(), attn_implementation=attn)
    return model.train() if train else model.eval()


def pair(name: str, device: str, attn: str = "eager", train: bool = False) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(cpu model, device copy) with identical weights."""
    cpu = build(name, attn, train)
    return cpu, copy.deepcopy(cpu).to(device)


def inputs(name: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 7), generator=g)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if FAMILIES[name].auto == "seq2seq":
        batch["decoder_input_ids"] = torch.randint(3, VOCAB, (2, 5), generator=g)
    return batch


def to(batch: dict[str, torch.Tensor], device: str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in batch.items()}
