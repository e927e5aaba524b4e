"""From logits to next tokens: logit bias, penalties, temperature, top-k / top-p / min-p, seeded
sampling, logprobs.

Rows are processed together where the operation is uniform and per row where it depends on the row's
history (penalties) or random stream (a seeded request draws from its own generator, so its output does
not depend on what else is in the batch). A row left with no token to choose (every logit -inf or NaN
after its request's transforms) gets an error instead of a token; the other rows are unaffected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from torchbridge.serve import cpu_kernels
from torchbridge.serve.sequence import Sequence


@dataclass
class Sampled:
    token_id: int
    logprob: dict | None  # {"token": id, "logprob": x, "top": [(id, x), ...]} when requested
    error: str | None = None  # set when no token could be chosen; token_id is then meaningless


NO_TOKEN = "no token can be sampled: the request's settings leave every token with zero probability"


def row_max(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's maximum and its first index, `logits.max(dim=-1)`'s results: for float32 logits on the
    CPU through the engine's kernel when it is loaded (serve/csrc/argmax.cpp; torch's indexed reduction is
    a scalar loop there, ~6 ms a step for 32 rows of a 128K vocabulary)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and cpu_kernels.loaded():
        return cpu_kernels.row_argmax(logits)
    return logits.max(dim=-1)


def apply_penalties(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    p = seq.params
    if p.repetition_penalty != 1.0:
        # Multiplicative penalty on every token seen in prompt or output (the CTRL / HF convention).
        seen = torch.tensor(sorted(set(seq.token_ids)), dtype=torch.long)
        vals = logits[seen]
        logits[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.presence_penalty or p.frequency_penalty) and seq.num_output_tokens:
        # Additive penalties on output tokens only (the OpenAI convention).
        counts = torch.bincount(torch.tensor(seq.output_ids, dtype=torch.long), minlength=logits.shape[0])
        counts = counts[: logits.shape[0]].to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def token_logprobs(logprobs_row: torch.Tensor, token: int, k: int) -> dict:
    top: list[tuple[int, float]] = []
    if k > 0:
        vals, idx = torch.topk(logprobs_row, k)
        top = list(zip(idx.tolist(), vals.tolist(), strict=True))
    return {"token": token, "logprob": float(logprobs_row[token]), "top": top}


def add_logit_bias(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """OpenAI's logit_bias, for all rows in one scatter-add."""
    rows, cols, vals = [], [], []
    for i, seq in enumerate(seqs):
        for t, v in seq.params.logit_bias.items():
            rows.append(i)
            cols.append(t)
            vals.append(v)
    if rows:
        logits.index_put_((torch.tensor(rows), torch.tensor(cols)), torch.tensor(vals, dtype=logits.dtype),
                          accumulate=True)


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: list[int] | None = None) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_token_ids = list(eos_token_ids or [])
        self._masks = None  # structured_output.TokenMasks, made with the first constrained row

    def process(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """Logit bias, penalties, min_tokens and grammar masks on a copy of the fp32 logits [rows, vocab];
        one row per seq. The grammar mask comes last, so nothing a request adds can revive a token its
        grammar forbids."""
        biased = any(s.params.logit_bias for s in seqs)
        constrained = any(s.matcher is not None for s in seqs)
        if not biased and not constrained and not any(s.params.has_penalties or s.params.min_tokens for s in seqs):
            return logits
        logits = logits.clone()
        if biased:
            add_logit_bias(logits, seqs)
        for i, seq in enumerate(seqs):
            p = seq.params
            if p.has_penalties:
                apply_penalties(logits[i], seq)
            # min_tokens yields to a grammar that has ended (it then allows only a stop token).
            if p.min_tokens and seq.num_output_tokens < p.min_tokens and not (
                    seq.matcher is not None and seq.matcher.is_completed()):  # type: ignore[attr-defined]
                banned = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
                if banned:
                    logits[i, banned] = float("-inf")
        if constrained:
            if self._masks is None:
                from torchbridge.serve.structured_output import TokenMasks

                self._masks = TokenMasks()
            self._masks.apply(logits, [s.matcher for s in seqs])
        return logits

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[Sampled]:
        raw_logprobs = None
        if any(s.params.logprobs is not None for s in seqs):
            # Logprobs of the model's own distribution, before any sampling transform (vLLM's default).
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = self.process(logits, seqs)
        best, tokens = row_max(logits)
        # NaN compares false too: a row whose best logit is not above -inf has nothing to choose.
        ok = (best > float("-inf")).tolist()
        random_rows = [i for i, s in enumerate(seqs) if not s.params.greedy and ok[i]]
        if random_rows:
            idx = torch.tensor(random_rows)
            probs = self._probs(logits[idx], [seqs[i] for i in random_rows])
            valid = (torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).tolist()
            for j, i in enumerate(random_rows):
                if not valid[j]:
                    ok[i] = False
                    continue
                gen = seqs[i].generator or self.generator
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        out = []
        for i, (seq, t) in enumerate(zip(seqs, tokens.tolist(), strict=True)):
            if not ok[i]:
                out.append(Sampled(-1, None, NO_TOKEN))
                continue
            lp = None
            if raw_logprobs is not None and seq.params.logprobs is not None:
                lp = token_logprobs(raw_logprobs[i], t, seq.params.logprobs)
            out.append(Sampled(t, lp))
        return out

    @staticmethod
    def _probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        vocab = logits.shape[-1]
        # Finite temperatures beyond float32's range would make inf / inf = NaN below.
        temp = torch.tensor([min(s.params.temperature, 1e30) for s in seqs], dtype=logits.dtype)
        logits = logits / temp[:, None]
        posinf = torch.isposinf(logits)
        inf_rows = posinf.any(dim=-1)
        if bool(inf_rows.any()):
            # An extreme penalty or bias sent some logits to +inf: the choice is uniform among them.
            logits = torch.where(inf_rows[:, None], torch.where(posinf, 0.0, float("-inf")), logits)
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if any(0 < k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            ks = torch.tensor([k if 0 < k < vocab else vocab for k in top_k])
            drop = torch.arange(vocab)[None, :] >= ks[:, None]
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p (the top one always stays).
            above = probs.cumsum(dim=-1) - probs
            drop |= above >= torch.tensor(top_p, dtype=probs.dtype)[:, None]
            drop[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
            logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
        probs = logits.softmax(dim=-1)
        min_p = torch.tensor([s.params.min_p for s in seqs], dtype=probs.dtype)
        if bool((min_p > 0).any()):
            keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, torch.zeros_like(probs))
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs
