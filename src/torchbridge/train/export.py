"""The trained model as a Hugging Face checkpoint that `transformers` and `torchbridge serve --model DIR` load.

Every rank takes part in gathering the full weights (FSDP2 shards and TP slices become whole tensors on
the CPU); rank 0 loads them into a fresh LlamaForCausalLM, casts to the export dtype and writes
config.json, model.safetensors, generation_config.json, the tokenizer and its chat template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from torchbridge.train.data import CHAT_TEMPLATE_FILE, IM_END

DIR = "model"


def export(model: nn.Module, config: Any, tokenizer: Any, out: Path, dtype: str) -> Path | None:
    """Write OUT/model on rank 0 (returns its path there, None elsewhere). Collective: call on every rank."""
    from transformers import GenerationConfig, LlamaForCausalLM

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() != 0:
        return None
    target = out / DIR
    target.mkdir(parents=True, exist_ok=True)
    hf = LlamaForCausalLM(config)
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not (m == "lm_head.weight" and config.tie_word_embeddings)]:
        raise RuntimeError(f"export: weights do not match the model (missing {missing}, unexpected {unexpected})")
    hf = hf.to(getattr(torch, dtype))
    hf.config.use_cache = True  # for generation; training ran without a KV cache
    hf.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)])
    hf.save_pretrained(target)
    tokenizer.chat_template = CHAT_TEMPLATE_FILE.read_text()
    tokenizer.save_pretrained(target)
    cfg_path = target / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    for key in ("is_local", "local_files_only"):  # load-time kwargs a reloaded tokenizer echoes back
        tok_cfg.pop(key, None)
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
    for p in target.iterdir():
        p.chmod(0o644)  # save_pretrained may write owner-only files; a packaged model must be readable
    return target
