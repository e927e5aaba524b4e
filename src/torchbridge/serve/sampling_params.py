"""Per-request sampling settings, validated up front so that bad values become HTTP 400s.

The ranges are vLLM's (and OpenAI's where OpenAI defines one); every float must be finite. The
engine checks what needs the model or the prompt (token ids within the vocabulary, max_tokens within
the context) when the request is added.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_N = 128  # OpenAI's bound on choices per request
MAX_LOGPROBS = 20
LOGIT_BIAS_LIMIT = 100.0


class InvalidParam(ValueError):
    """A sampling setting out of its range; `param` names it (the `param` of the HTTP error)."""

    def __init__(self, param: str, why: str) -> None:
        super().__init__(f"{param} {why}")
        self.param = param


@dataclass
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k >= 0: chosen token's logprob plus the top k
    min_tokens: int = 0
    # OpenAI's logit_bias: token id -> value in [-100, 100], added to the logits before sampling.
    logit_bias: dict[int, float] = field(default_factory=dict)
    # A grammar the output must follow (structured_output.GuidedSpec), or None.
    guided: object | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        if self.top_k == 0:
            self.top_k = -1
        self.validate()

    def validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, int | float) or not math.isfinite(v):
                raise InvalidParam(name, f"must be a finite number, got {v}")
        if not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InvalidParam("n", f"must be in [1, {MAX_N}], got {self.n}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InvalidParam("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InvalidParam("temperature", f"must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidParam("top_p", f"must be in (0, 1], got {self.top_p}")
        if not -1 <= self.top_k <= INT64_MAX:
            raise InvalidParam("top_k", f"must be -1 or 0 (off) or positive, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise InvalidParam("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise InvalidParam("repetition_penalty", f"must be positive, got {self.repetition_penalty}")
        if not -2 <= self.presence_penalty <= 2:
            raise InvalidParam("presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise InvalidParam("frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX:
            raise InvalidParam("seed", f"must fit a signed 64-bit integer, got {self.seed}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidParam("logprobs", f"must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.min_tokens < 0:
            raise InvalidParam("min_tokens", f"must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidParam("min_tokens", f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        if any(t < 0 for t in self.stop_token_ids):
            raise InvalidParam("stop_token_ids", "must be non-negative token ids")
        for t, v in self.logit_bias.items():
            if t < 0:
                raise InvalidParam("logit_bias", f"keys must be non-negative token ids, got {t}")
            if not math.isfinite(v) or not -LOGIT_BIAS_LIMIT <= v <= LOGIT_BIAS_LIMIT:
                raise InvalidParam("logit_bias", f"values must be in [-100, 100], got {v} for token {t}")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids the request names must exist in the model's vocabulary."""
        for name, ids in (("stop_token_ids", self.stop_token_ids), ("logit_bias", self.logit_bias)):
            bad = [t for t in ids if t >= vocab_size]
            if bad:
                raise InvalidParam(name, f"token ids must be below the vocabulary size {vocab_size}, got {bad[0]}")

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
