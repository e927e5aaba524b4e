"""Speculative decoding by n-gram prompt lookup.

The proposer looks for the latest earlier occurrence of the sequence's last n tokens (longest n first)
and proposes the k tokens that followed it. The engine feeds [last token, drafts] in one step and keeps
the drafts up to the first one that differs from the model's own greedy choice, plus that choice: the
output is exactly greedy decoding, only with fewer steps when the text repeats itself. Only greedy
requests without penalties speculate, since only there is "the model's choice" a pure function of the
logits row.
"""

from __future__ import annotations

import numpy as np

from torchbridge.serve.sequence import Sequence


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, ngram_min: int = 1, ngram_max: int = 3) -> None:
        self.k = num_speculative_tokens
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @staticmethod
    def eligible(seq: Sequence) -> bool:
        p = seq.params
        # Drafts are verified against the model's raw greedy choice: requests whose logits are transformed
        # (penalties, min_tokens, logit bias, a grammar) decode one token at a time.
        return p.greedy and not p.has_penalties and not p.min_tokens and not p.logit_bias and p.guided is None

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

    def record(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted:
            self.num_drafts += 1
            self.num_draft_tokens += num_drafted
            self.num_accepted_tokens += num_accepted

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
