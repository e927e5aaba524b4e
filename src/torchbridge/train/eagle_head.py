"""EAGLE's draft head as a trainable module, built from Hugging Face's Llama modules, and its loss.

The training twin of the engine's head (serve/models/eagle.py): the same function, written with
transformers' `LlamaModel` (one layer, its input norm and final norm dropped), so that the engine's head is
checked against an implementation it shares no code with (tests/serve/test_spec_decode_eagle.py).
scripts/distill_draft.py --method eagle trains it and writes the checkpoint the engine loads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class EagleHead(torch.nn.Module):
    """`cfg`: a transformers LlamaConfig with one layer; `target`: the Hugging Face model it drafts for
    (its embedding and LM head are read, never trained or saved)."""

    def __init__(self, cfg: object, target: torch.nn.Module) -> None:
        from transformers import LlamaModel

        super().__init__()
        h = cfg.hidden_size  # type: ignore[attr-defined]
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.body = LlamaModel(cfg)
        del self.body.embed_tokens  # the input is fc's output (inputs_embeds)
        self.body.norm = torch.nn.Identity()
        self.body.layers[0].input_layernorm = torch.nn.Identity()
        self.target = [target]  # frozen, not a submodule: not trained, not saved

    def forward(self, next_ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Predicted features [B, T, H] from the next tokens [B, T] and the target's features [B, T, H]."""
        emb = self.target[0].get_input_embeddings()(next_ids)
        return self.body(inputs_embeds=self.fc(torch.cat([emb, features], dim=-1))).last_hidden_state

    def state_for_checkpoint(self) -> dict[str, torch.Tensor]:
        """EAGLE's names: fc.*, layers.0.* (serve/models/eagle.py reads them)."""
        out = {"fc.weight": self.fc.weight}
        out.update({f"layers.{k}": v for k, v in self.body.layers.state_dict().items()})
        return {k: v.detach().contiguous() for k, v in out.items()}


def eagle_loss(target: torch.nn.Module, head: EagleHead, ids: torch.Tensor, unroll: int) -> tuple[torch.Tensor, float]:
    """KL + smooth-L1 of the head's next feature, over `unroll` passes (pass 2 reads pass 1's predictions)."""
    with torch.no_grad():
        feats = target.model(ids).last_hidden_state.float()
        log_p = F.log_softmax(target.lm_head(feats[:, 1:]).float(), -1)
    inputs = feats[:, :-1]
    total, agree = torch.zeros(()), 0.0
    for i in range(unroll):
        pred = head(ids[:, 1:], inputs)
        log_q = F.log_softmax(target.lm_head(pred).float(), -1)
        kl = (log_p.exp() * (log_p - log_q)).sum(-1).mean()
        total = total + kl + F.smooth_l1_loss(pred, feats[:, 1:])
        if i == 0:  # the greedy agreement from the target's own features (a proposal's first draft)
            agree = float((log_p.argmax(-1) == log_q.argmax(-1)).float().mean())
        # the next pass: position t reads the feature predicted for it (position 0 keeps the true one)
        inputs = torch.cat([feats[:, :1], pred[:, :-1]], dim=1)
    return total / unroll, agree
