"""EAGLE's draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty"), in the checkpoint layout vLLM's `{"method": "eagle", "model": DIR}` loads.

The head drafts from the target's own features. At position i it takes the target's final hidden state
f_i (what the target's LM head reads) and the embedding of the next token x_{i+1}, mixes the two with one
linear layer (`fc`: 2 x hidden -> hidden) and a Llama decoder layer whose input norm is dropped (its input
is a mix of normalised features, not a residual stream), and predicts f_{i+1}; the target's LM head turns
that into logits for x_{i+2}. Drafting k tokens feeds each prediction back as the next feature. The LM
head is always the target's, the embedding too unless the checkpoint carries its own copy; a checkpoint
holds `fc.*` and `layers.0.*` (names without the `model.` prefix, as EAGLE's releases write them).
"""

from __future__ import annotations

import torch
from torch import nn

from torchbridge.serve.attention import AttentionMetadata
from torchbridge.serve.config import ModelConfig
from torchbridge.serve.linear import Linear
from torchbridge.serve.models.llama import KVCache, LlamaForCausalLM

# Parameters a head may leave out of its checkpoint: the target's are used.
SHARED = ("model.embed_tokens.weight", "lm_head.weight")


def checkpoint_name(name: str) -> str:
    """A head checkpoint's tensor name as this module names it (EAGLE's releases drop `model.`)."""
    return name if name.startswith(("model.", "lm_head.")) else f"model.{name}"


class EagleHead(LlamaForCausalLM):
    """`fc_bias`: whether the checkpoint's `fc` has a bias (EAGLE-1's releases do, later ones not)."""

    def __init__(self, cfg: ModelConfig, max_positions: int, fc_bias: bool = False) -> None:
        super().__init__(cfg, max_positions)
        del self.model.norm  # the head's output is the predicted feature itself
        self.model.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.model.layers[0].input_layernorm = nn.Identity()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: KVCache,  # type: ignore[override]
                meta: AttentionMetadata, features: torch.Tensor) -> torch.Tensor:
        """Predicted features [N, hidden] from the next tokens' ids [N] and the target's features [N, hidden]."""
        x = self.model.embed_tokens(input_ids)
        x = self.model.fc(torch.cat([x, features.to(x.dtype)], dim=-1))
        return self.run_layers(x, positions, kv_caches, meta)

    def share(self, target: LlamaForCausalLM, own_embedding: bool) -> None:
        """Read the target's LM head (and embedding, unless the checkpoint had one): the same tensors, no copy."""
        if not own_embedding:
            self.model.embed_tokens = target.model.embed_tokens
        self.lm_head = target.lm_head
