"""One generation stream: prompt + output tokens, its cache blocks and its progress.

A request with `n > 1` becomes n sequences that share the prompt (and, with prefix caching, the
prompt's KV blocks).
"""

from __future__ import annotations

import enum
import itertools
import time

import torch

from torchbridge.serve.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_ids = itertools.count()


class Sequence:
    def __init__(self, request_id: str, index: int, prompt_ids: list[int], params: SamplingParams) -> None:
        self.seq_id = next(_ids)
        self.request_id = request_id
        self.index = index  # position among the request's n choices
        self.prompt_len = len(prompt_ids)
        self.token_ids: list[int] = list(prompt_ids)
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []
        # Tokens whose K/V are in the cache; the rest (up to len(token_ids)) still need a forward pass.
        self.num_computed_tokens = 0
        # Async scheduling: tokens a step in flight is sampling, not yet in token_ids (the next step is
        # scheduled, and fed them, before they are known); `ends_pending`: the last of them ends the
        # sequence by length, so no step after it is scheduled.
        self.num_pending = 0
        self.ends_pending = False
        # Full blocks of this sequence already registered in the prefix cache.
        self.num_hashed_blocks = 0
        self.block_hashes: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict] = []  # per output token: {"token": id, "logprob": x, "top": [(id, x), ...]}
        self.arrival_time = time.monotonic()
        self.first_token_time: float | None = None
        self.last_token_time = 0.0
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            # Distinct but reproducible streams for the n choices of one seeded request.
            self.generator = torch.Generator().manual_seed(params.seed + index)
        # Set by the engine's detokenizer (detokenizer.Detokenizer, made with the first output token).
        self.detok: object | None = None
        self.text = ""
        self.emitted_text_len = 0
        self.num_emitted_tokens = 0
        self.draft_tokens: list[int] = []
        # Tokens whose K/V the draft model or EAGLE head (spec_decode) has in its cache.
        self.draft_num_computed = 0
        # An EAGLE head's pending input: the target's final hidden states of the positions after those.
        self.spec_hidden: torch.Tensor | None = None
        # The grammar matcher of a constrained request (structured_output), set by the engine.
        self.matcher: object | None = None

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) + self.num_pending - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id}, {self.status.value}, len={len(self.token_ids)}, computed={self.num_computed_tokens})"
