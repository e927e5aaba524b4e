"""Speculative decoding: proposers, the rejection sampler, and the acceptance counters.

A proposer guesses the next k tokens of a decoding sequence; the engine feeds [last token, drafts] to
the target model in one step and keeps a prefix of the drafts plus one token of its own:

- greedy requests keep drafts while they equal the target's argmax, then add the argmax: the output is
  exactly greedy decoding, in fewer steps;
- sampled requests go through `rejection_sample` (Leviathan et al. 2023, "Fast inference from
  transformers via speculative decoding", Algorithm 1): draft x ~ q is accepted with probability
  min(1, p(x) / q(x)); at the first rejection the token is drawn from norm(max(0, p - q)); after k
  acceptances a bonus token is drawn from p. Every emitted token is then distributed exactly as the
  target's own sampling would be (tests/serve/test_spec_decode.py checks it with a chi-square test).
  A deterministic proposer (n-gram) is the case q = one-hot(draft).

Proposers (`SpeculativeConfig.method`, vLLM's `--speculative-config` JSON):
- "ngram": prompt lookup; the latest earlier occurrence of the last n tokens (longest n first) and the
  k tokens that followed it. No model; q is one-hot.
- "draft_model": a small model with the target's vocabulary (`model`: its checkpoint directory) runs
  k autoregressive steps on its own KV pool, which shares the target's block tables (same block ids,
  same block size), so it needs no allocator of its own.
- "eagle": EAGLE's head (models/eagle.py; `model`: its checkpoint directory) drafts from the target's own
  final hidden states, which the engine hands it after every step; its one-layer KV pool shares the
  target's block tables the same way.

Requests whose logits the sampler transforms with their history (penalties), bans (min_tokens), biases
or a grammar decode one token at a time: their p at a draft position would depend on the drafts before
it in ways the proposer does not model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from torchbridge.serve.sequence import Sequence

if TYPE_CHECKING:
    from torchbridge.serve.config import EngineConfig
    from torchbridge.serve.sampler import Sampler
    from torchbridge.serve.scheduler import ScheduledSeq

log = logging.getLogger(__name__)

METHODS = ("ngram", "draft_model", "eagle")
# vLLM's other methods, named so that a config written for vLLM gets a clear refusal, not a KeyError.
_UNSUPPORTED = ("eagle3", "medusa", "mlp_speculator", "mtp", "suffix")


@dataclass
class SpeculativeConfig:
    """vLLM's `--speculative-config` (the fields this engine uses; others are refused by name)."""

    method: str = "ngram"
    num_speculative_tokens: int = 3
    model: str | None = None  # draft_model, eagle: the draft's (head's) checkpoint directory
    prompt_lookup_min: int = 1  # ngram: shortest n
    prompt_lookup_max: int = 3  # ngram: longest n

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From vLLM's JSON (a string or a dict). A `model` without a `method` is a draft model, as in vLLM."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        try:
            d = json.loads(value) if isinstance(value, str) else value
        except json.JSONDecodeError as e:
            raise ValueError(f"speculative config is not JSON: {e}") from None
        if not isinstance(d, dict):
            raise ValueError("speculative config must be a JSON object")
        d = dict(d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"speculative config: unknown keys {unknown}; known: {sorted(known)}")
        if "method" not in d:
            d["method"] = "draft_model" if d.get("model") else "ngram"
        cfg = cls(**d)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.method in _UNSUPPORTED:
            raise ValueError(f"speculative method {self.method!r} is not implemented here; use one of {METHODS}")
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r}: expected one of {METHODS}")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be at least 1")
        if self.method in ("draft_model", "eagle"):
            if not self.model or not (Path(self.model) / "config.json").is_file():
                raise ValueError(f"{self.method} needs `model`: a Hugging Face checkpoint directory (got {self.model!r})")
        elif not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("ngram needs 1 <= prompt_lookup_min <= prompt_lookup_max")


@dataclass
class SpecStats:
    """vLLM's spec-decode counters: proposals verified, tokens drafted, tokens accepted (overall and by
    draft position). Acceptance rate = accepted / drafted; mean acceptance length (tokens per verifying
    step, the bonus token included) = 1 + accepted / drafts."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if not num_drafted:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_drafted:
            self.accepted_per_pos += [0] * (num_drafted - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def eligible(seq: Sequence) -> bool:
    p = seq.params
    return not p.has_penalties and not p.min_tokens and not p.logit_bias and p.guided is None


# ---- the rejection sampler -----------------------------------------------------------------------------
def _accept(u: torch.Tensor, p_draft: torch.Tensor, q_draft: torch.Tensor) -> torch.Tensor:
    """Leviathan et al.'s rule: accept with probability min(1, p/q), i.e. u < p/q for u ~ U[0, 1)
    (written without the division: q can be 0 where a caller passes a one-hot q)."""
    return u * q_draft < p_draft


def rejection_sample(target_probs: torch.Tensor, draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                     generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for B rows of k drafts each.

    target_probs [B, k+1, V]: the target's sampling distribution at each draft position and after the
    last; draft_tokens [B, k]; draft_probs [B, k, V], the distributions the drafts were drawn from, or
    None for a deterministic proposer (q = one-hot). Returns (tokens [B, k+1], accepted [B]): row b emits
    tokens[b, : accepted[b] + 1] (the accepted drafts, then the resampled or bonus token)."""
    b, k1, vocab = target_probs.shape
    k = k1 - 1
    rows = torch.arange(b)
    p_draft = target_probs[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)
    if draft_probs is None:
        q_full = torch.nn.functional.one_hot(draft_tokens, vocab).to(target_probs.dtype)
    else:
        q_full = draft_probs.to(target_probs.dtype)
    q_draft = q_full.gather(-1, draft_tokens[..., None]).squeeze(-1)
    u = torch.rand((b, k), generator=generator, dtype=target_probs.dtype)
    accepted = _accept(u, p_draft, q_draft).to(torch.long).cumprod(dim=-1).sum(dim=-1)
    # The next token's distribution: max(0, p - q) normalised at the first rejection; p after all k
    # (q there is zero: the pad row).
    q_pad = torch.cat([q_full, torch.zeros((b, 1, vocab), dtype=q_full.dtype)], dim=1)
    p_next = target_probs[rows, accepted]
    residual = (p_next - q_pad[rows, accepted]).clamp_min(0)
    total = residual.sum(dim=-1, keepdim=True)
    # total == 0 means p == q at that position, where a rejection has probability 0: only rounding gets here.
    residual = torch.where(total > 0, residual / total.clamp_min(torch.finfo(total.dtype).tiny), p_next)
    nxt = torch.multinomial(residual, 1, generator=generator).squeeze(-1)
    tokens = torch.cat([draft_tokens, torch.zeros((b, 1), dtype=draft_tokens.dtype)], dim=1)
    tokens[rows, accepted] = nxt
    return tokens, accepted


# ---- proposers -------------------------------------------------------------------------------------------
class NgramProposer:
    """Prompt lookup: called before scheduling, with the exact drafts (the scheduler budgets them)."""

    needs_model = False
    needs_hidden = False

    def __init__(self, num_speculative_tokens: int, ngram_min: int = 1, ngram_max: int = 3) -> None:
        self.k = num_speculative_tokens
        self.ngram_min, self.ngram_max = ngram_min, ngram_max

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        k = min(self.k, limit)
        if k <= 0 or len(tokens) < self.ngram_min + 1:
            return []
        arr = np.asarray(tokens, dtype=np.int64)
        for n in range(min(self.ngram_max, len(tokens) - 1), self.ngram_min - 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(arr[:-1], n)
            hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k]
        return []


class _Extended:
    """A sequence's tokens followed by the drafts proposed so far, without copying the sequence's list:
    what ModelRunner.prepare reads of `token_ids` (its length and slices). `shift` = 1: the tokens one
    position ahead (an EAGLE head's input at position i is token i + 1)."""

    __slots__ = ("base", "extra", "shift")

    def __init__(self, base: list[int], extra: list[int], shift: int = 0) -> None:
        self.base, self.extra, self.shift = base, extra, shift

    def __len__(self) -> int:
        return len(self.base) - self.shift + len(self.extra)

    def __getitem__(self, s: slice) -> list[int]:
        n = len(self.base) - self.shift
        start, stop, _ = s.indices(n + len(self.extra))
        return (self.base[start + self.shift : min(stop, n) + self.shift]
                + self.extra[max(start - n, 0) : max(stop - n, 0)])


@dataclass
class _DraftView:
    """What the draft's model runner reads of a sequence: its own progress over the target's blocks."""

    seq_id: int
    token_ids: _Extended
    num_computed_tokens: int
    block_table: list[int]
    num_pending: int = 0  # (the draft runs synchronously: no token of it is sampled in flight)


class DraftModelProposer:
    """A draft model's k autoregressive steps, after scheduling (the scheduler reserves k slots).

    The draft keeps its own KV pool with the target's geometry and reads it through the target's block
    tables; `seq.draft_num_computed` counts the tokens whose draft K/V are in it. Each proposal first
    catches the draft up (the whole prompt the first time, else the one or two tokens the last step
    added), then runs one token per step for every sequence still drafting."""

    needs_model = True
    needs_hidden = False

    def __init__(self, config: EngineConfig, spec: SpeculativeConfig) -> None:
        from torchbridge.serve.model_runner import ModelRunner

        self.k = spec.num_speculative_tokens
        assert spec.model is not None
        # The draft shares the target's cache geometry (block ids index both pools) and device; its
        # decodes gather from the paged pool (no workspace: a rejected draft rolls its positions back).
        draft_cfg = dataclasses.replace(
            config, model=spec.model, decode_workspace=False, speculative_config=None, speculative_ngram=0,
            kv_events=False, served_model_name=None)
        vocab, draft_vocab = config.model_config.vocab_size, draft_cfg.model_config.vocab_size
        if draft_vocab != vocab:
            raise ValueError(f"the draft model's vocabulary ({draft_vocab}) differs from the target's ({vocab})")
        self.runner = ModelRunner(draft_cfg)

    def propose(self, items: list[ScheduledSeq], sampler: Sampler) -> list[torch.Tensor | None]:
        """Fill each item's draft_tokens (their count was reserved by the scheduler); returns per item the
        draft distributions [k, V] its drafts were sampled from (None for greedy rows: argmax drafts)."""
        from torchbridge.serve.scheduler import Batch, ScheduledSeq

        want = [len(it.draft_tokens) for it in items]
        drafts: list[list[int]] = [[] for _ in items]
        q_rows: list[list[torch.Tensor]] = [[] for _ in items]
        views = []
        for it in items:
            seq = it.seq
            seq.draft_num_computed = min(seq.draft_num_computed, seq.num_computed_tokens)
            views.append(_DraftView(seq.seq_id, _Extended(seq.token_ids, []), seq.draft_num_computed, seq.block_table))
        for step in range(max(want, default=0)):
            live = [i for i, w in enumerate(want) if w > step]
            batch = Batch([ScheduledSeq(views[i], len(views[i].token_ids) - views[i].num_computed_tokens)  # type: ignore[arg-type]
                           for i in live])
            logits, rows = self.runner.run(batch)
            for i, (row, count) in zip(live, rows, strict=True):
                assert count == 1
                views[i].num_computed_tokens = len(views[i].token_ids)
                _draw(logits[row : row + 1], items[i].seq, sampler, views[i], drafts[i], q_rows[i])
        out: list[torch.Tensor | None] = []
        for i, it in enumerate(items):
            it.draft_tokens = drafts[i]
            it.seq.draft_tokens = drafts[i]
            # K/V written: through the last token the draft was fed (the last draft itself never is).
            it.seq.draft_num_computed = views[i].num_computed_tokens
            out.append(torch.stack(q_rows[i]) if q_rows[i] else None)
        return out


def _draw(logits: torch.Tensor, seq: Sequence, sampler: Sampler, view: _DraftView, drafts: list[int],
          q_rows: list[torch.Tensor]) -> None:
    """The next draft from a proposer's logits [1, V]: the argmax for greedy requests; else sampled with the
    request's own settings (temperature, top-k/p, min-p), keeping the distribution it came from."""
    if seq.params.greedy:
        tok = int(logits.argmax(dim=-1))
    else:
        q = sampler._probs(logits, [seq])
        tok = int(torch.multinomial(q[0], 1, generator=seq.generator or sampler.generator))
        q_rows.append(q[0])
    drafts.append(tok)
    view.token_ids.extra.append(tok)


class EagleProposer:
    """EAGLE's head (models/eagle.py) drafting from the target's features, after scheduling (the scheduler
    reserves k slots, as for a draft model).

    The head's one-layer KV pool has the target's block ids and is read through the target's block tables.
    `seq.draft_num_computed` counts the positions whose head K/V came from the target's own features, and
    `seq.spec_hidden` holds the target's features of the positions after them that the head has not been fed
    (the engine passes every step's final hidden states to `record`). A proposal feeds those (with the next
    tokens' ids), which drafts the first token, then k - 1 steps feed the head's own predicted feature; the
    head's K/V of those positions is recomputed from the target's features at the next proposal.

    Positions in a prefix-cache hit were never computed by the target in this sequence: the head starts
    after them and reads whatever head K/V its pool holds in those blocks (the K/V of the sequence that
    filled them). That costs acceptance at worst, never correctness: every draft is verified."""

    needs_model = True
    needs_hidden = True

    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, target: torch.nn.Module) -> None:
        from torchbridge.serve.model_runner import ModelRunner

        self.k = spec.num_speculative_tokens
        assert spec.model is not None
        head_cfg = dataclasses.replace(
            config, model=spec.model, decode_workspace=False, speculative_config=None, speculative_ngram=0,
            kv_events=False, served_model_name=None)
        mc, hc = config.model_config, head_cfg.model_config
        if (hc.vocab_size, hc.hidden_size) != (mc.vocab_size, mc.hidden_size):
            raise ValueError(f"the EAGLE head's vocabulary and width ({hc.vocab_size}, {hc.hidden_size}) differ from "
                             f"the target's ({mc.vocab_size}, {mc.hidden_size})")
        self.runner = ModelRunner(head_cfg, target=target, keep_hidden=True)

    @staticmethod
    def record(seq: Sequence, hidden: torch.Tensor, position: int) -> None:
        """The target's final hidden states of `seq`'s tokens at `position`, `position` + 1, ... (only those it
        kept: rejected drafts' rows are not passed)."""
        if not eligible(seq):  # never drafts: nothing would consume them
            seq.spec_hidden = None
            return
        h = seq.spec_hidden
        if h is not None and seq.draft_num_computed + h.shape[0] == position:
            seq.spec_hidden = torch.cat([h, hidden])
        else:  # the sequence's first step here (after a prefix-cache hit, or a recompute): the head starts here
            seq.spec_hidden = hidden.clone()
            seq.draft_num_computed = position

    def propose(self, items: list[ScheduledSeq], sampler: Sampler) -> list[torch.Tensor | None]:
        """Fill each item's draft_tokens (their count was reserved by the scheduler); returns per item the
        draft distributions [k, V] its drafts were sampled from (None for greedy rows: argmax drafts)."""
        from torchbridge.serve.scheduler import Batch, ScheduledSeq

        want = [len(it.draft_tokens) for it in items]
        drafts: list[list[int]] = [[] for _ in items]
        q_rows: list[list[torch.Tensor]] = [[] for _ in items]
        views: list[_DraftView | None] = []
        features: list[torch.Tensor | None] = []
        for i, it in enumerate(items):
            seq = it.seq
            h = seq.spec_hidden
            if h is None or not h.shape[0] or seq.draft_num_computed + h.shape[0] != seq.num_computed_tokens:
                want[i] = 0  # (no features for some positions before this one: no drafts this step)
                views.append(None)
                features.append(None)
                continue
            views.append(_DraftView(seq.seq_id, _Extended(seq.token_ids, [], shift=1), seq.draft_num_computed,
                                    seq.block_table))
            features.append(h)
        for step in range(max(want, default=0)):
            live = [i for i, w in enumerate(want) if w > step]
            batch = Batch([ScheduledSeq(views[i], len(views[i].token_ids) - views[i].num_computed_tokens)  # type: ignore[arg-type, union-attr]
                           for i in live])
            logits, rows = self.runner.run(batch, features=torch.cat([features[i] for i in live]))  # type: ignore[misc]
            hidden = self.runner.last_hidden
            assert hidden is not None
            end = 0
            for i, (row, count) in zip(live, rows, strict=True):
                assert count == 1
                view = views[i]
                assert view is not None
                end += len(view.token_ids) - view.num_computed_tokens
                features[i] = hidden[end - 1 : end]  # the predicted feature of the next position
                view.num_computed_tokens = len(view.token_ids)
                _draw(logits[row : row + 1], items[i].seq, sampler, view, drafts[i], q_rows[i])
        out: list[torch.Tensor | None] = []
        for i, it in enumerate(items):
            seq = it.seq
            it.draft_tokens = seq.draft_tokens = drafts[i]
            if views[i] is not None:
                # Head K/V from the target's features: every position before the one the target is fed now.
                seq.draft_num_computed, seq.spec_hidden = seq.num_computed_tokens, None
            out.append(torch.stack(q_rows[i]) if q_rows[i] else None)
        return out


def make_proposer(config: EngineConfig, target: torch.nn.Module) -> NgramProposer | DraftModelProposer | EagleProposer | None:
    """`target`: the engine's model (an EAGLE head shares its embedding and LM head)."""
    spec = config.speculative_config
    if spec is None:
        return None
    if spec.method == "ngram":
        return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.method == "eagle":
        return EagleProposer(config, spec, target)
    return DraftModelProposer(config, spec)
