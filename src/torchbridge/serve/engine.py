"""The engine: requests in, tokens out, one `step()` at a time.

Data flows one way: a request becomes sequences, the scheduler picks a batch, the model runner turns it
into logits, the sampler (or the speculative verifier) into tokens, and the output side into text
deltas and finish reasons. The engine is synchronous and single-threaded; `AsyncEngine` drives it from a
thread for the HTTP server.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from torchbridge.serve.block_manager import BlockManager
from torchbridge.serve.config import EngineConfig
from torchbridge.serve.kv_events import KVEventLog
from torchbridge.serve.model_runner import ModelRunner, StepInput, plan
from torchbridge.serve.sampler import NO_TOKEN, Sampled, Sampler, row_max, token_logprobs
from torchbridge.serve.sampling_params import InvalidParam, SamplingParams
from torchbridge.serve.scheduler import Batch, ScheduledSeq, Scheduler
from torchbridge.serve.sequence import Sequence, Status
from torchbridge.serve.spec_decode import SpecStats, eligible, make_proposer, rejection_sample
from torchbridge.serve.tokenizer import tokenizer_of

log = logging.getLogger(__name__)


class InvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seqs: list[Sequence]
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)


@dataclass
class SeqUpdate:
    """What one step added to one sequence (the stream delta), plus its state when finished."""

    request_id: str
    index: int
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[dict]
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    seq: Sequence
    error: str | None = None  # the request failed inside the engine (finish_reason "error")


@dataclass
class Stats:
    prompt_tokens: int = 0  # prompt tokens of admitted requests
    computed_prompt_tokens: int = 0  # prompt tokens that went through the model (prefix-cache misses)
    generation_tokens: int = 0
    finished_requests: int = 0
    steps: int = 0


@dataclass
class _InFlight:
    """A launched step (async scheduling): its batch, what waits for its logits, and each item's rows."""

    batch: Batch
    wait: Callable[[], torch.Tensor]
    rows: list[tuple[int, int]]


class LLMEngine:
    def __init__(self, config: EngineConfig, load_tokenizer: bool = True) -> None:
        self.config = config
        mc = config.model_config
        self.tokenizer = tokenizer_of(config.model) if load_tokenizer else None
        eos = list(mc.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        spec = config.speculative_config
        # An EAGLE head drafts from the target's final hidden states: every step keeps them.
        self.runner = ModelRunner(config, keep_hidden=spec is not None and spec.method == "eagle")  # type: ignore[attr-defined]
        self.kv_events = KVEventLog() if config.kv_events else None
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.enable_prefix_caching, self.kv_events)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.sampler = Sampler(config.seed, eos)
        self.proposer = make_proposer(config, self.runner.model)
        self.spec_stats = SpecStats()
        self.requests: dict[str, Request] = {}
        self._grammars = None  # structured_output.GrammarCompiler, made with the first constrained request
        self.warmup_pending: list[tuple[str, int, int]] = []  # buckets warm_idle() still has to run
        # Characters a prompt of max_model_len tokens can have at most, so that a longer text is refused
        # without tokenizing it (tokenizing megabytes takes seconds and gigabytes).
        self.max_prompt_chars = (
            config.max_model_len * self.tokenizer.max_token_chars if self.tokenizer is not None else None
        )
        self.stats = Stats()
        self.metrics = None  # set by the server: an object with observe_* hooks (see metrics.py)
        # Async scheduling (config.async_scheduling): the step in flight while the next is scheduled.
        self.async_scheduling = bool(config.async_scheduling) and self.proposer is None and self.runner.launches
        self._inflight: _InFlight | None = None

    # ---- requests in -------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams, add_special_tokens: bool = True,
        strict_length: bool = False,
    ) -> Request:
        """Queue a prompt (text, or token ids). Chat prompts arrive as rendered template text, which
        already holds its special tokens: pass add_special_tokens=False for them. With strict_length a
        max_tokens that cannot fit the context is refused (vLLM's server) instead of capped."""
        if request_id in self.requests:
            raise InvalidRequest(f"duplicate request id {request_id}")
        max_len = self.config.max_model_len
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("this model has no tokenizer; send token ids", "prompt")
            if self.max_prompt_chars is not None and len(prompt) > self.max_prompt_chars:
                raise InvalidRequest(
                    f"this model's maximum context length is {max_len} tokens; the prompt has {len(prompt)} "
                    f"characters, more than {max_len} tokens of this tokenizer can hold", "prompt")
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens)
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", "prompt")
        vocab = self.config.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", "prompt")
        try:
            params.check_vocab(vocab)
        except InvalidParam as e:
            raise InvalidRequest(str(e), e.param) from None
        if len(prompt_ids) >= max_len:
            raise InvalidRequest(
                f"this model's maximum context length is {max_len} tokens; the prompt has {len(prompt_ids)}", "prompt"
            )
        if strict_length and params.max_tokens is not None and len(prompt_ids) + params.max_tokens > max_len:
            raise InvalidRequest(
                f"max_tokens is too large: {params.max_tokens}. This model's maximum context length is {max_len} "
                f"tokens and your request has {len(prompt_ids)} input tokens "
                f"({params.max_tokens} > {max_len} - {len(prompt_ids)})", "max_tokens")
        if self.block_manager.blocks_for(len(prompt_ids) + 1) > self.config.num_blocks:
            raise InvalidRequest(f"the prompt ({len(prompt_ids)} tokens) does not fit the KV cache", "prompt")
        seqs = [Sequence(request_id, i, prompt_ids, params) for i in range(params.n)]
        if params.guided is not None:
            try:
                params.guided = self.grammars.compile(params.guided)  # type: ignore[arg-type]
            except InvalidParam as e:
                raise InvalidRequest(str(e), e.param) from None
            for s in seqs:
                s.matcher = self.grammars.matcher(params.guided)  # type: ignore[arg-type]
        req = Request(request_id, prompt_ids, params, seqs)
        self.requests[request_id] = req
        self.stats.prompt_tokens += len(prompt_ids) * params.n
        for s in seqs:
            self.scheduler.add(s)
        return req

    def abort_request(self, request_id: str) -> None:
        """Cancel a request (client gone): its blocks go back to the pool now."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for s in req.seqs:
            if not s.is_finished:
                self.scheduler.remove(s)
                s.status, s.finish_reason = Status.FINISHED, "abort"

    @property
    def grammars(self):  # noqa: ANN201 - structured_output.GrammarCompiler (xgrammar imported on first use)
        if self._grammars is None:
            if self.tokenizer is None:
                raise InvalidRequest("structured outputs need the model's tokenizer", "response_format")
            from torchbridge.serve.structured_output import GrammarCompiler

            self._grammars = GrammarCompiler(self.tokenizer.hf, self.config.model_config.vocab_size, self.eos_token_ids)
        return self._grammars

    def fail_request(self, request_id: str, message: str) -> list[SeqUpdate]:
        """End every unfinished sequence of a request with an error (a failure inside a step that
        concerns it); its blocks go back to the pool, the rest of the engine carries on."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return []
        out = []
        for s in req.seqs:
            if not s.is_finished:
                self.scheduler.remove(s)
                s.status, s.finish_reason = Status.FINISHED, "error"
                out.append(SeqUpdate(s.request_id, s.index, [], "", [], True, "error", None, s, message))
        return out

    def fail_all(self, message: str) -> list[SeqUpdate]:
        """Fail every request in the engine (a step failed outside any one request's part)."""
        return [u for rid in list(self.requests) for u in self.fail_request(rid, message)]

    def has_unfinished(self) -> bool:
        return self._inflight is not None or self.scheduler.has_work()

    # ---- one step ----------------------------------------------------------------------------
    def step(self) -> list[SeqUpdate]:
        """One scheduled batch through the model and the sampler. A failure fails only the requests it
        concerns: the model's, every request in the batch; a sampling or output failure, its request."""
        steps, prompt, generated = self.stats.steps, self.stats.computed_prompt_tokens, self.stats.generation_tokens
        updates = self._step()
        if self.metrics is not None and self.stats.steps != steps:
            # vLLM's iteration tokens: prompt tokens computed plus tokens generated by the step
            self.metrics.observe_iteration(self.stats.computed_prompt_tokens - prompt
                                           + self.stats.generation_tokens - generated)
        return updates

    def _step(self) -> list[SeqUpdate]:
        if self.async_scheduling:
            return self._step_async()
        if self.proposer is not None:
            self._propose()
        batch = self.scheduler.schedule()
        updates = [self._finish(s, "length") for s in batch.aborted_for_space]
        if not batch.items:
            return updates
        self.stats.steps += 1
        draft_probs = self._propose_with_model(batch) if self.proposer is not None and self.proposer.needs_model else {}
        try:
            logits, rows = self.runner.run(batch)
        except Exception as e:  # noqa: BLE001 - the batch's requests fail; the engine goes on
            return updates + self._fail_batch(batch, e)
        starts = [it.seq.num_computed_tokens for it in batch.items]  # (the first position fed, per item)
        new_tokens: dict[int, tuple[Sequence, list[int], list[dict]]] = {}
        plain: list[tuple[Sequence, int]] = []
        failed: dict[str, str] = {}
        for it, (row, count) in zip(batch.items, rows, strict=True):
            seq = it.seq
            self._count_computed(it)
            if count == 0:
                self.block_manager.commit(seq)
            elif it.draft_tokens:
                try:
                    new_tokens[seq.seq_id] = (seq, *self._verify(seq, it.draft_tokens, logits[row : row + count],
                                                                  draft_probs.get(seq.seq_id)))
                except Exception as e:  # noqa: BLE001
                    failed[seq.request_id] = self._failure("verifying drafts", e)
            else:
                plain.append((seq, row))
        sampled, sample_failed = self._sample_tokens(logits, plain)
        failed.update(sample_failed)
        new_tokens.update((seq.seq_id, (seq, *sampled[seq.seq_id])) for seq, _ in plain if seq.seq_id in sampled)
        if self.proposer is not None and self.proposer.needs_hidden:
            self._record_hidden(batch, starts, new_tokens)
        for seq, toks, lps in new_tokens.values():
            if seq.request_id in failed:
                continue
            try:
                updates.append(self._append(seq, toks, lps))
            except Exception as e:  # noqa: BLE001
                failed[seq.request_id] = self._failure("detokenizing", e)
        for rid, message in failed.items():
            updates += self.fail_request(rid, message)
        return updates

    def _step_async(self) -> list[SeqUpdate]:
        """One step of async scheduling: schedule and prepare step k while step k - 1 runs; wait for k - 1
        and sample it; feed its new tokens to k and launch k; then turn k - 1's tokens into outputs while k
        runs. Only the sampling and the launch keep the device waiting. A sequence that k - 1 ends (a stop
        token, a stop string, an abort) was fed to k too: that row's result is dropped, and its K/V write
        lands in blocks freed after k was launched, so before any later step can reuse them."""
        batch = self.scheduler.schedule()
        updates = [self._finish(s, "length") for s in batch.aborted_for_space]
        prev, self._inflight = self._inflight, None
        inp = start = None
        if batch.items:
            try:
                inp = self.runner.prepare(plan(batch, self.config.block_size))
                start = self.runner.stage(inp)  # (all of the launch that does not need the new tokens)
            except Exception as e:  # noqa: BLE001 - the batch's requests fail; the engine goes on
                updates += self._fail_batch(batch, e)
        sampled: dict[int, tuple[list[int], list[dict]]] = {}
        failed: dict[str, str] = {}
        if prev is not None:
            try:
                logits = prev.wait()
            except Exception as e:  # noqa: BLE001
                # k was not launched: its sequences are scheduled again next step (their state is unchanged)
                return updates + self._fail_batch(prev.batch, e)
            sampled, failed = self._sample_tokens(logits, [
                (it.seq, row) for it, (row, count) in zip(prev.batch.items, prev.rows, strict=True)
                if count and not it.seq.is_finished])  # (those that ended meanwhile: not sampled)
        if start is not None and inp is not None:
            updates += self._launch(batch, inp, start, sampled)
        if prev is not None:
            updates += self._outputs_async(prev, sampled, failed)
        return updates

    def _fail_batch(self, batch: Batch, e: Exception) -> list[SeqUpdate]:
        log.exception("model step failed; failing the %d request(s) in its batch", len(batch.items))
        failed = {it.seq.request_id for it in batch.items}
        return [u for rid in failed for u in self.fail_request(rid, f"model step failed: {e}")]

    def _launch(self, batch: Batch, inp: StepInput, start: Callable[[], Callable[[], torch.Tensor]],
                sampled: dict[int, tuple[list[int], list[dict]]]) -> list[SeqUpdate]:
        """Feed each sequence's token from the step before (sampled just now), launch, and count the step's
        tokens as computed (what follows is scheduled as if they were). The updates: of a failed launch."""
        first = 0
        for it in batch.items:
            seq = it.seq
            if seq.num_pending:  # its last fed token was being sampled: 0 until now (plan())
                toks = sampled.get(seq.seq_id)
                inp.input_ids[first + it.num_tokens - 1] = toks[0][0] if toks else 0
            first += it.num_tokens
        self.stats.steps += 1
        try:
            wait = start()
        except Exception as e:  # noqa: BLE001
            return self._fail_batch(batch, e)
        max_len = self.config.max_model_len
        for it in batch.items:
            seq = it.seq
            samples = it.samples  # (before the tokens count as computed)
            self._count_computed(it)
            if samples:
                seq.num_pending += 1
                out = seq.num_output_tokens + seq.num_pending
                seq.ends_pending = out >= self._max_tokens(seq) or seq.prompt_len + out >= max_len
        self._inflight = _InFlight(batch, wait, inp.rows)
        return []

    def _count_computed(self, it: ScheduledSeq) -> None:
        """A scheduled item's tokens are in the cache now (or will be, in the order the device runs steps)."""
        seq = it.seq
        if seq.num_computed_tokens < seq.prompt_len:
            self.stats.computed_prompt_tokens += min(it.num_tokens, seq.prompt_len - seq.num_computed_tokens)
        seq.num_computed_tokens += it.num_tokens

    def _sample_tokens(self, logits: torch.Tensor, plain: list[tuple[Sequence, int]]
                       ) -> tuple[dict[int, tuple[list[int], list[dict]]], dict[str, str]]:
        """The sampled token (and its logprobs) of each plain row, by sequence id, and an error message per
        request whose sampling failed."""
        sampled, failed = {}, {}
        for (seq, _), s in zip(plain, self._sample(logits, plain), strict=True):
            if isinstance(s, str):
                failed[seq.request_id] = s
            else:
                sampled[seq.seq_id] = ([s.token_id], [s.logprob] if s.logprob else [])
        return sampled, failed

    def _outputs_async(self, prev: _InFlight, sampled: dict[int, tuple[list[int], list[dict]]],
                       failed: dict[str, str]) -> list[SeqUpdate]:
        updates = []
        for it, (_, count) in zip(prev.batch.items, prev.rows, strict=True):
            seq = it.seq
            if count:
                seq.num_pending -= 1
            if seq.is_finished or seq.request_id in failed:
                continue
            if not count:
                self.block_manager.commit(seq)
                continue
            try:
                updates.append(self._append(seq, *sampled[seq.seq_id]))
            except Exception as e:  # noqa: BLE001
                failed[seq.request_id] = self._failure("detokenizing", e)
        for rid, message in failed.items():
            updates += self.fail_request(rid, message)
        return updates

    def _record_hidden(self, batch: Batch, starts: list[int],
                       new_tokens: dict[int, tuple[Sequence, list[int], list[dict]]]) -> None:
        """Hand the step's final hidden states of the tokens each sequence kept (a prefill chunk's, the
        decode token's and its accepted drafts') to the proposer."""
        hidden = self.runner.last_hidden
        assert hidden is not None
        first = 0
        for it, start in zip(batch.items, starts, strict=True):
            kept = it.num_tokens
            if it.draft_tokens and it.seq.seq_id in new_tokens:
                kept += len(new_tokens[it.seq.seq_id][1]) - 1  # the accepted drafts
            self.proposer.record(it.seq, hidden[first : first + kept], start)  # type: ignore[union-attr]
            first += it.num_tokens + len(it.draft_tokens)

    def _sample(self, logits: torch.Tensor, plain: list[tuple[Sequence, int]]) -> list[Sampled | str]:
        """Sampled tokens of the plain rows, or an error message per row that failed. The batch is
        sampled at once; only if that raises are the rows retried one by one to find the failing ones."""
        if not plain:
            return []
        seqs = [s for s, _ in plain]
        rows = [r for _, r in plain]
        # every row, in order (a plain decode step): no gathered copy (the sampler copies before it changes any)
        picked = logits if rows == list(range(logits.shape[0])) else logits[rows]
        try:
            out: list[Sampled | str] = list(self.sampler.sample(picked, seqs))
        except Exception:  # noqa: BLE001
            out = []
            for seq, r in plain:
                try:
                    out.append(self.sampler.sample(logits[[r]], [seq])[0])
                except Exception as e:  # noqa: BLE001
                    out.append(self._failure("sampling", e))
        return [o.error if isinstance(o, Sampled) and o.error else o for o in out]

    @staticmethod
    def _failure(stage: str, e: Exception) -> str:
        log.exception("%s failed for one request; failing it", stage)
        return f"{stage} failed: {type(e).__name__}: {e}"

    def _propose(self) -> None:
        """Drafts (n-gram) or reserved draft slots (draft model) for every running sequence that decodes
        one token this step; the scheduler budgets and allocates for them."""
        assert self.proposer is not None
        max_len = self.config.max_model_len
        for seq in self.scheduler.running:
            seq.draft_tokens = []
            if seq.num_uncomputed == 1 and eligible(seq):
                room = min(self._max_tokens(seq) - seq.num_output_tokens, max_len - len(seq.token_ids)) - 1
                if self.proposer.needs_model:
                    seq.draft_tokens = [0] * max(0, min(self.proposer.k, room))  # filled after scheduling
                else:
                    seq.draft_tokens = self.proposer.propose(seq.token_ids, room)  # type: ignore[union-attr]

    def _propose_with_model(self, batch: Batch) -> dict[int, torch.Tensor]:
        """The draft model's tokens for the slots the scheduler kept; the distributions sampled drafts came
        from, by sequence. A failing draft model costs speculation for this step, not the requests."""
        items = [it for it in batch.items if it.draft_tokens]
        if not items:
            return {}
        try:
            qs = self.proposer.propose(items, self.sampler)  # type: ignore[union-attr]
        except Exception:  # noqa: BLE001
            log.exception("the draft model failed; these sequences decode without drafts this step")
            for it in items:
                it.draft_tokens = it.seq.draft_tokens = []
                it.seq.draft_num_computed, it.seq.spec_hidden = 0, None
            return {}
        return {it.seq.seq_id: q for it, q in zip(items, qs, strict=True) if q is not None}

    def _verify(self, seq: Sequence, drafts: list[int], logits: torch.Tensor,
                draft_probs: torch.Tensor | None = None) -> tuple[list[int], list[dict]]:
        """Greedy: keep drafts while they equal the model's argmax, then add the argmax. Sampled: the
        rejection sampler (spec_decode.rejection_sample), whose tokens follow the model's distribution."""
        assert self.proposer is not None
        if seq.params.greedy:
            target = row_max(logits)[1].tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == target[accepted]:
                accepted += 1
            toks = target[: accepted + 1]
        else:
            probs = self.sampler._probs(logits, [seq] * logits.shape[0])
            if not bool((torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0)).all()):
                raise ValueError(NO_TOKEN)
            out, acc = rejection_sample(probs[None], torch.tensor([drafts]),
                                        None if draft_probs is None else draft_probs[None],
                                        seq.generator or self.sampler.generator)
            accepted = int(acc[0])
            toks = out[0, : accepted + 1].tolist()
        self.spec_stats.record(len(drafts), accepted)
        # Accepted drafts were fed with their K/V written at the right positions: they count as computed.
        seq.num_computed_tokens += accepted
        lps = []
        if seq.params.logprobs is not None:
            rows = torch.log_softmax(logits[: accepted + 1], dim=-1)
            lps = [token_logprobs(rows[i], t, seq.params.logprobs) for i, t in enumerate(toks)]
        return toks, lps

    # ---- tokens out --------------------------------------------------------------------------
    def _max_tokens(self, seq: Sequence) -> int:
        mt = seq.params.max_tokens
        return mt if mt is not None else self.config.max_model_len - seq.prompt_len

    def _append(self, seq: Sequence, tokens: list[int], logprobs: list[dict]) -> SeqUpdate:
        p = seq.params
        now = time.monotonic()
        if seq.first_token_time is None:
            seq.first_token_time = now
            if self.metrics is not None:
                self.metrics.observe_ttft(now - seq.arrival_time)
        elif self.metrics is not None:
            self.metrics.observe_itl(now - seq.last_token_time)
        seq.last_token_time = now
        finish: tuple[str, int | str | None] | None = None
        for i, t in enumerate(tokens):
            seq.token_ids.append(t)
            if logprobs:
                seq.logprobs.append(logprobs[i])
            self.stats.generation_tokens += 1
            if seq.matcher is not None:
                if not seq.matcher.accept_token(t):  # type: ignore[attr-defined]
                    raise RuntimeError(f"token {t} is not allowed by the request's grammar")
                if seq.matcher.is_terminated():  # type: ignore[attr-defined]
                    finish = ("stop", None)  # the grammar accepted a stop token: the output is complete
                    break
            if t in p.stop_token_ids:
                finish = ("stop", t)
            elif not p.ignore_eos and t in self.eos_token_ids and seq.num_output_tokens > p.min_tokens:
                finish = ("stop", None)
            elif seq.num_output_tokens >= self._max_tokens(seq) or len(seq.token_ids) >= self.config.max_model_len:
                finish = ("length", None)
            if finish:
                break
        seq.num_computed_tokens = min(seq.num_computed_tokens, len(seq.token_ids))
        self.block_manager.commit(seq)
        # A stop token or EOS ends the text but is not part of it.
        hide_last = finish is not None and finish[0] == "stop"
        if self.tokenizer is not None:
            if seq.detok is None:
                seq.detok = self.tokenizer.detokenizer(seq.prompt_len)
            detok = seq.detok
            end = len(seq.token_ids) - (1 if hide_last else 0)
            prev = len(detok.text)  # type: ignore[attr-defined]
            detok.step(seq.token_ids, end)  # type: ignore[attr-defined]
            if finish is not None:
                detok.finish(seq.token_ids, end)  # type: ignore[attr-defined]
            text = detok.text  # type: ignore[attr-defined]
            if p.stop and len(text) > prev:
                # Only text that is new can complete a stop string; one found ends the output there, also
                # when the same step hit max_tokens or a stop token (the string came first).
                longest = max(len(s) for s in p.stop)
                start = max(0, prev - longest + 1)
                hits = [(text.find(s, start), s) for s in p.stop]
                hits = [(i, s) for i, s in hits if i >= 0]
                if hits:
                    i, s = min(hits)
                    text, finish = text[:i], ("stop", s)
            seq.text = text
        if finish is not None:
            seq.finish_reason, seq.stop_reason = finish
        return self._update(seq, finish is not None)

    def _update(self, seq: Sequence, finished: bool) -> SeqUpdate:
        text = seq.text
        upto = len(text)
        if not finished:
            if seq.params.stop:
                # A stop string may still be completing: hold back what could be its beginning.
                upto -= max(len(s) for s in seq.params.stop) - 1
            while upto > 0 and text[upto - 1] == "\ufffd":  # an incomplete UTF-8 sequence
                upto -= 1
        upto = max(upto, seq.emitted_text_len)
        new_text = text[seq.emitted_text_len : upto]
        seq.emitted_text_len = upto
        new_ids = seq.token_ids[seq.prompt_len + seq.num_emitted_tokens :]  # not output_ids: that copies all
        new_lps = seq.logprobs[seq.num_emitted_tokens :]
        seq.num_emitted_tokens = seq.num_output_tokens
        if finished:
            self._retire(seq)
        return SeqUpdate(seq.request_id, seq.index, new_ids, new_text, new_lps, finished, seq.finish_reason, seq.stop_reason, seq)

    def _finish(self, seq: Sequence, reason: str) -> SeqUpdate:
        seq.finish_reason = reason
        return self._update(seq, True)

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.remove(seq)
        seq.status = Status.FINISHED
        req = self.requests.get(seq.request_id)
        if req is not None and req.finished:
            del self.requests[seq.request_id]
            self.stats.finished_requests += 1
            if self.metrics is not None:
                self.metrics.observe_finished(req)

    def warmup(self, everything: bool = True) -> int:
        """Run the shape buckets the configured limits allow once (ModelRunner.bucket_shapes); the count run.
        `everything=False`: only the smallest bucket of each kind (decode, prefill), which carries the
        kind's one trace (seconds each; a bucket after it costs a compile, ~0.07 s with a warm program
        cache), and the rest left for idle time (`warm_idle`): a server is healthy that much sooner."""
        shapes = self.runner.bucket_shapes(self.config.max_num_seqs, self.config.max_num_batched_tokens)
        first = shapes if everything else [next(s for s in shapes if s[0] == kind)
                                           for kind in dict.fromkeys(s[0] for s in shapes)]
        self.runner.warm(first)
        self.warmup_pending = [s for s in shapes if s not in first]
        log.info("warmed up %d shape buckets%s", len(first),
                 f"; {len(self.warmup_pending)} more while idle" if self.warmup_pending else "")
        return len(first)

    def warm_idle(self) -> None:
        """Warm one bucket left by `warmup(everything=False)`; call when no request is in flight. A failure
        is logged and ends the background warm-up (the bucket then compiles when a step needs it)."""
        if not self.warmup_pending:
            return
        shape = self.warmup_pending.pop(0)
        try:
            self.runner.warm([shape], progress=False)
        except Exception:
            log.exception("warming shape bucket %s failed; the rest compile when first used", shape)
            self.warmup_pending.clear()
            return
        if not self.warmup_pending:
            log.info("warmed up every shape bucket")

    def kv_events_since(self, since: int, limit: int) -> dict | None:
        """KV-cache events from id `since` (KVEventLog.since), or None when they are off."""
        return None if self.kv_events is None else self.kv_events.since(since, limit)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers, if any (nothing to stop otherwise); no step after this."""
        self.runner.shutdown()

    # ---- introspection -----------------------------------------------------------------------
    @property
    def failure(self) -> str | None:
        """Why the engine cannot step any more (a tensor-parallel worker exited), or None."""
        workers = self.runner.workers
        return None if workers is None else workers.error

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
