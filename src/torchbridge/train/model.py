"""The model: Hugging Face's LlamaForCausalLM, built from the [model] section and the tokenizer.

Hugging Face's code is the model so that the export is exactly what `transformers` and the engine load,
and so that the trainer adds nothing to model code: parallelisms, activation checkpointing and
compilation are applied from outside (parallelize.py). The weights are initialised on the CPU from the
seed, then moved, so every device and every rank count starts from the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch

from torchbridge.train.config import ModelSection


def hf_config(m: ModelSection, vocab_size: int, tokenizer: Any) -> Any:  # LlamaConfig
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=m.hidden_size, intermediate_size=m.intermediate_size,
        num_hidden_layers=m.num_layers, num_attention_heads=m.num_heads, num_key_value_heads=m.num_kv_heads,
        max_position_embeddings=m.max_position_embeddings, rope_theta=m.rope_theta, rms_norm_eps=m.rms_norm_eps,
        initializer_range=m.initializer_range, tie_word_embeddings=m.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        attention_bias=False, mlp_bias=False, use_cache=False)


def build(config: Any, seed: int) -> torch.nn.Module:
    """An fp32 LlamaForCausalLM on the CPU, initialised from `seed` (SDPA attention, no KV cache)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).float()


def num_params(model: torch.nn.Module) -> int:
    """Distinct parameters (tied ones once); full sizes even when sharded (a DTensor's shape is global)."""
    return sum({id(p): p.numel() for p in model.parameters()}.values())


def flops_per_token(config: Any, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per parameter in a product (forward + backward; the input embedding is a
    lookup, so it counts only when tied to the output projection) plus attention's score and value
    products, 12 * layers * heads * head_dim * seq_len (PaLM's appendix B; what TorchTitan counts)."""
    if not config.tie_word_embeddings:
        n_params -= config.vocab_size * config.hidden_size
    head_dim = config.hidden_size // config.num_attention_heads
    return 6 * n_params + 12 * config.num_hidden_layers * config.num_attention_heads * head_dim * seq_len
