"""Continuous batching with chunked prefill under a per-step token budget.

Each step first serves running sequences (decodes, continuing prefills) in arrival order, then admits
waiting ones while budget, sequence slots and free blocks last. A sequence whose next tokens need blocks
the pool does not have preempts the most recently admitted running sequence (its blocks are freed and it
is recomputed later, cheaply when its blocks are still in the prefix cache). Nothing here crashes on a
full pool: the worst case is a lone sequence that cannot grow, which finishes with reason "length".
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from torchbridge.serve.block_manager import BlockManager
from torchbridge.serve.sequence import Sequence, Status


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_tokens: int  # uncomputed tokens processed this step (a prefill chunk, or 1 for a decode)
    draft_tokens: list[int] = field(default_factory=list)  # speculative tokens verified after them

    @property
    def samples(self) -> bool:
        """Whether this step reaches the end of the sequence, i.e. produces its next token."""
        return self.seq.num_computed_tokens + self.num_tokens == len(self.seq.token_ids) + self.seq.num_pending


@dataclass
class Batch:
    items: list[ScheduledSeq]
    preempted: list[Sequence] = field(default_factory=list)
    aborted_for_space: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(it.num_tokens + len(it.draft_tokens) for it in self.items)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or cancelled sequence and give its blocks back at once."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.bm.release(seq)

    def _preempt(self, seq: Sequence, batch: Batch) -> None:
        self.running.remove(seq)
        self.bm.release(seq)
        seq.num_computed_tokens = 0
        seq.draft_num_computed = 0  # the draft model's K/V lived in the freed blocks too
        seq.spec_hidden = None
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def schedule(self) -> Batch:
        batch = Batch(items=[])
        budget = self.max_num_batched_tokens
        scheduled: set[int] = set()
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.ends_pending:  # its last token is being sampled: nothing more to compute
                i += 1
                continue
            n = min(seq.num_uncomputed, budget)
            drafts = seq.draft_tokens if n == seq.num_uncomputed == 1 else []
            drafts = drafts[: budget - n]
            while not self.bm.allocate(seq, seq.num_computed_tokens + n + len(drafts)):
                if drafts:
                    drafts = []
                    continue
                victim = self.running[-1]
                if victim is seq:
                    break
                self._preempt(victim, batch)
            else:
                batch.items.append(ScheduledSeq(seq, n, list(drafts)))
                scheduled.add(seq.seq_id)
                budget -= n + len(drafts)
                i += 1
                continue
            # seq could not get a block even after preempting everything admitted after it.
            if len(self.running) == 1:
                # Alone and still short of blocks: it holds the whole pool and can never grow, so end it
                # instead of preempting and readmitting it forever.
                self.running.remove(seq)
                batch.aborted_for_space.append(seq)
            else:
                self._preempt(seq, batch)
            break
        if batch.preempted:
            return batch
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self.bm.lookup(seq)
            cached_tokens = len(cached) * self.bm.block_size
            n = min(len(seq.token_ids) - cached_tokens, budget)
            if not self.bm.can_take(cached, cached_tokens + n):
                if not self.running and not batch.items:
                    # Even an empty pool cannot hold this chunk: it would wait forever.
                    self.waiting.popleft()
                    batch.aborted_for_space.append(seq)
                    continue
                break
            self.waiting.popleft()
            self.bm.record_lookup(seq, cached_tokens)
            self.bm.take_cached(seq, cached)
            ok = self.bm.allocate(seq, cached_tokens + n)
            assert ok, "can_take promised room"
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.items.append(ScheduledSeq(seq, n))
            budget -= n
        return batch
