"""A discrete-event simulator of a replica pool behind the real `EndpointPicker`.

Replica model (continuous batching like torchbridge.serve's scheduler and vLLM):
  * a FIFO waiting queue; each engine step first serves the running sequences in admission order
    (a decode is one token; a sequence still prefilling gets its next chunk), then admits waiting
    requests while the step's token budget (`max_batched_tokens`, None = unlimited, i.e. no
    chunked prefill), the batch (`max_batch`) and free KV blocks last;
  * a step takes step_overhead_s + decode_step(decoding sequences, their context) +
    prefill_time(prefill tokens, attention pairs), where prefill tokens counts only uncached prompt
    tokens: a request's prefill costs its uncached tokens, and every decoding sequence on the replica
    waits for it (a long re-prefill slows the whole batch, chunked or not);
  * attention grows with context: a prompt token at position p attends to p + 1 keys, a decoding
    sequence reads its whole context every step. `prefill_attn_s` (per query-key pair) and
    `decode_attn_s` (per context token per step) charge for it; with both 0 every token costs the
    same at any context length (the flat model of earlier runs). Within a pure-decode stretch each
    step is longer than the last by decode_attn_s x batch (every context grew by one token);
  * KV memory is a block pool of `kv_blocks` blocks, as in the engine's block manager: blocks are
    reference counted, so a prefix cached once (the system prompt) is shared by every sequence that
    uses it; a request reserves the blocks for its prompt and its whole output at admission (the
    engine allocates output blocks lazily and preempts instead; reserving is the conservative
    version and needs no preemption); the full blocks of its prompt join the prefix cache when its
    prefill completes, those of prompt + output when it finishes; blocks nobody references stay
    cached and are evicted least recently freed first (a released chain tail before its head) only
    when an allocation needs room. Prefix cache and running sequences therefore compete for the
    same `kv_blocks`: a context evicted under memory pressure is recomputed in full next time;
  * a request's cached tokens are its longest cached prefix at admission (at least one prompt
    token is always computed, as in the engine).

Pure-decode stretches are simulated in epochs (one event per batch change, not per token), so
1,000 replicas run in minutes. The router's load table is written from the simulated replicas
either at once (`scrape_interval_s=0`: perfectly fresh metrics) or by a periodic scrape of all
replicas (a real router's view); its in-flight accounting is exactly the proxy's, at once.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from .index import block_hashes
from .picker import Decision, EndpointPicker


@dataclass
class ReplicaModel:
    prefill_tps: float = 4000.0        # prompt tokens per second
    decode_base_s: float = 0.025       # decode step time at batch 1 ...
    decode_per_seq_s: float = 0.001    # ... plus this per sequence in the batch
    kv_blocks: int = 4096
    block_size: int = 16
    max_batch: int = 32
    step_overhead_s: float = 0.0       # fixed cost added to a step that prefills
    max_batched_tokens: int | None = None  # token budget per step (chunked prefill); None = unlimited
    prefill_attn_s: float = 0.0        # per (prompt token, key it attends to) pair
    decode_attn_s: float = 0.0         # per context token of each decoding sequence, per step

    def decode_step(self, batch: int, context: int = 0) -> float:
        """One step decoding `batch` sequences whose contexts total `context` tokens."""
        return self.decode_base_s + self.decode_per_seq_s * batch + self.decode_attn_s * context if batch else 0.0

    def prefill_time(self, tokens: int, pairs: float = 0.0) -> float:
        """Prefilling `tokens` prompt tokens whose queries see `pairs` keys in all."""
        return tokens / self.prefill_tps + self.prefill_attn_s * pairs


def attention_pairs(done: int, n: int) -> float:
    """Query-key pairs of prompt positions done .. done + n - 1 (position p sees p + 1 keys)."""
    return n * done + n * (n + 1) / 2


@dataclass
class SimRequest:
    rid: int
    hashes: list[int]
    n_prompt: int
    max_tokens: int
    arrival: float
    session: str | None = None
    on_done: Callable[[SimRequest], None] | None = None
    # Chained hashes of the full blocks of prompt + output (a continuation of `hashes`); when
    # given, the output's blocks join the replica's prefix cache at finish, as in the engine.
    final_hashes: list[int] | None = None
    # filled in by the simulation
    replica: str = ""
    decision: Decision | None = None
    cached_tokens: int = 0
    generated: int = 0
    first_token: float = math.nan
    finish: float = math.nan
    blocks: int = 0
    prefill_left: int = 0
    decision_latency_s: float = 0.0
    own: list[int] = field(default_factory=list)   # hashed KV blocks it references
    anon: int = 0                                  # KV blocks it holds that carry no hash

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival


class BlockPool:
    """KV blocks of one replica: hashed blocks in use (reference counted), unreferenced cached
    blocks in LRU order, and a count of in-use blocks without a hash; what is left is empty."""

    def __init__(self, n_blocks: int) -> None:
        self.n_blocks = n_blocks
        self.ref: dict[int, int] = {}
        self.free_cached: OrderedDict[int, None] = OrderedDict()
        self.anon = 0
        self.evicted = 0             # cached blocks dropped to make room (a counter, for reports)

    @property
    def used(self) -> int:
        return len(self.ref) + self.anon

    def cached_prefix(self, hashes: list[int]) -> int:
        n = 0
        for h in hashes:
            if h in self.ref or h in self.free_cached:
                n += 1
            else:
                break
        return n

    def fits(self, hashes: list[int], hit: int, total: int) -> bool:
        revive = sum(1 for h in hashes[:hit] if h in self.free_cached)
        return total - hit + revive <= self.n_blocks - self.used

    def take(self, req: SimRequest, hit: int, total: int) -> None:
        for h in req.hashes[:hit]:
            if h in self.free_cached:
                del self.free_cached[h]
            self.ref[h] = self.ref.get(h, 0) + 1
        req.own = list(req.hashes[:hit])
        req.anon = total - hit
        self.anon += req.anon
        self._evict()

    def commit(self, req: SimRequest, hashes: list[int]) -> None:
        """The request's blocks from len(req.own) up to len(hashes) now hold those hashes.
        A hash some other block already holds stays on an anonymous duplicate (engine rule)."""
        for h in hashes[len(req.own):]:
            if req.anon == 0:
                break
            if h in self.ref or h in self.free_cached:
                continue
            self.ref[h] = 1
            req.anon -= 1
            self.anon -= 1
            req.own.append(h)

    def release(self, req: SimRequest) -> None:
        for h in reversed(req.own):
            n = self.ref[h] - 1
            if n:
                self.ref[h] = n
            else:
                del self.ref[h]
                self.free_cached[h] = None
        self.anon -= req.anon
        req.own, req.anon = [], 0

    def _evict(self) -> None:
        over = self.used + len(self.free_cached) - self.n_blocks
        while over > 0 and self.free_cached:
            self.free_cached.popitem(last=False)
            self.evicted += 1
            over -= 1


class SimReplica:
    def __init__(self, name: str, model: ReplicaModel, sim: Simulator) -> None:
        self.name = name
        self.m = model
        self.sim = sim
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.pool = BlockPool(model.kv_blocks)
        self.mode = "idle"           # idle | step | decode
        self.plan: list[tuple[SimRequest, int]] = []
        self.epoch_start = 0.0
        self.step = 0.0              # a pure-decode epoch's first step ...
        self.growth = 0.0            # ... and how much longer each following step is
        self.version = 0
        self.next_event = math.inf
        self.prefill_tokens = 0      # uncached prompt tokens computed (a counter, for reports)

    @property
    def kv_used(self) -> int:
        return self.pool.used

    # -- scheduling ----------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        self.waiting.append(req)
        now = self.sim.now
        if self.mode == "idle":
            self._schedule(now, self._boundary)
        elif self.mode == "decode" and len(self.running) < self.m.max_batch:
            # A pure-decode epoch is one event; stop it at the next step boundary to admit.
            k = math.ceil(self._steps_in(now - self.epoch_start) - 1e-9)
            t = self.epoch_start + self._epoch_time(k)
            if t < self.next_event - 1e-12:
                self._schedule(t, self._boundary)
        self._publish()

    def _schedule(self, t: float, fn: Callable[[], None]) -> None:
        self.version += 1
        self.next_event = t
        v = self.version
        self.sim.at(t, lambda: fn() if v == self.version else None)

    def _epoch_time(self, k: int) -> float:
        """Time the first k steps of the current pure-decode epoch take."""
        return k * self.step + self.growth * k * (k - 1) / 2

    def _steps_in(self, dt: float) -> float:
        """The (real) number of epoch steps that fit in dt: the root of _epoch_time(k) = dt, in the
        form without cancellation when growth is tiny (it is exactly dt / step when growth is 0)."""
        b = self.step - self.growth / 2
        return 2 * dt / (b + math.sqrt(b * b + 2 * self.growth * dt))

    def _boundary(self) -> None:
        now = self.sim.now
        if self.mode == "decode":
            steps = int(round(self._steps_in(now - self.epoch_start)))
            for r in self.running:
                r.generated += steps
        elif self.mode == "step":
            for r, n in self.plan:
                if r.prefill_left:
                    r.prefill_left -= n
                    if not r.prefill_left:
                        r.generated = 1
                        r.first_token = now
                        self.pool.commit(r, r.hashes)
                        self.sim.first_token(r)
                else:
                    r.generated += 1
        self.plan = []
        self._finish_done()
        self._next()

    def _finish_done(self) -> None:
        now = self.sim.now
        still = []
        for r in self.running:
            if r.generated >= r.max_tokens:
                r.finish = now
                if r.final_hashes is not None:
                    self.pool.commit(r, r.final_hashes)
                self.pool.release(r)
                self.sim.finished(r)
            else:
                still.append(r)
        self.running = still

    def _next(self) -> None:
        m = self.m
        budget = m.max_batched_tokens if m.max_batched_tokens is not None else math.inf
        plan: list[tuple[SimRequest, int]] = []
        n_decode = prefill = context = 0
        pairs = 0.0
        for r in self.running:
            if budget <= 0:
                break
            if r.prefill_left:
                n = int(min(r.prefill_left, budget))
                prefill += n
                pairs += attention_pairs(r.n_prompt - r.prefill_left, n)
            else:
                n = 1
                n_decode += 1
                context += r.n_prompt + r.generated
            plan.append((r, n))
            budget -= n
        pool = self.pool
        while self.waiting and budget > 0 and len(self.running) < m.max_batch:
            r = self.waiting[0]
            total = -(-(r.n_prompt + r.max_tokens) // m.block_size)
            hit = pool.cached_prefix(r.hashes)
            if not pool.fits(r.hashes, hit, total) and (self.running or plan):
                break  # wait for memory; a lone oversized request is admitted anyway
            self.waiting.popleft()
            pool.take(r, hit, total)
            r.blocks = total
            r.cached_tokens = min(hit * m.block_size, max(0, r.n_prompt - 1))
            r.prefill_left = r.n_prompt - r.cached_tokens
            n = int(min(r.prefill_left, budget))
            prefill += n
            pairs += attention_pairs(r.cached_tokens, n)
            budget -= n
            plan.append((r, n))
            self.running.append(r)
        self.prefill_tokens += prefill
        if prefill:
            self.mode = "step"
            self.plan = plan
            dt = m.step_overhead_s + m.decode_step(n_decode, context) + m.prefill_time(prefill, pairs)
            self._schedule(self.sim.now + dt, self._boundary)
        elif self.running:
            self.mode = "decode"
            self.epoch_start = self.sim.now
            self.step = m.decode_step(len(self.running), sum(r.n_prompt + r.generated for r in self.running))
            self.growth = m.decode_attn_s * len(self.running)
            remaining = min(r.max_tokens - r.generated for r in self.running)
            self._schedule(self.sim.now + self._epoch_time(remaining), self._boundary)
        else:
            self.mode = "idle"
            self.version += 1
            self.next_event = math.inf
        self._publish()

    def _publish(self) -> None:
        """What a scrape of this replica would report: into the router's table at once, or into
        the simulator's scrape buffer that a periodic scrape copies over."""
        slot = self.sim.picker.pool.slots.get(self.name)
        if slot is not None:
            q, run, kv = self.sim.scraped if self.sim.scrape_interval_s else (
                self.sim.picker.pool.queue, self.sim.picker.pool.running, self.sim.picker.pool.kv_usage)
            q[slot] = len(self.waiting)
            run[slot] = len(self.running)
            kv[slot] = min(1.0, self.pool.used / self.m.kv_blocks)


class Simulator:
    """Event loop + pool. Drive it with `submit()` from workload callbacks, then `run(until)`."""

    def __init__(self, picker: EndpointPicker, models: dict[str, ReplicaModel], profile: str | None = None,
                 scrape_interval_s: float = 0.0, route: Callable[[SimRequest], str] | None = None) -> None:
        self.picker = picker
        self.profile = profile
        self.route = route  # replaces the picker (bounds and what-ifs); None = the real picker decides
        self.now = 0.0
        self._q: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.replicas: dict[str, SimReplica] = {}
        self.done: list[SimRequest] = []
        self.scrape_interval_s = scrape_interval_s
        for name, model in models.items():
            picker.add_replica(name, kv_blocks=model.kv_blocks)
            slot = picker.pool.slots[name]
            picker.pool.prefill_tps[slot] = model.prefill_tps
            picker.pool.block_size[slot] = model.block_size
        n = len(picker.pool.names)
        self.scraped = (np.zeros(n), np.zeros(n), np.zeros(n))
        for name, model in models.items():
            self.replicas[name] = SimReplica(name, model, self)
        if scrape_interval_s:
            self.at(scrape_interval_s, self._scrape)

    def _scrape(self) -> None:
        pool = self.picker.pool
        q, run, kv = self.scraped
        pool.queue[:len(q)] = q
        pool.running[:len(run)] = run
        pool.kv_usage[:len(kv)] = kv
        if self._q:  # keep scraping while anything else is scheduled
            self.at(self.now + self.scrape_interval_s, self._scrape)

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, fn))

    def submit(self, req: SimRequest) -> None:
        if self.route is not None:
            req.replica = self.route(req)
            self.replicas[req.replica].submit(req)
            return
        ctx = self.picker.request_from_hashes(req.hashes, req.n_prompt, req.session)
        d = self.picker.pick(ctx, self.profile)
        self.picker.on_dispatch(d, req.session)
        req.decision = d
        req.replica = d.replica
        req.decision_latency_s = d.latency_s
        self.replicas[d.replica].submit(req)

    def first_token(self, req: SimRequest) -> None:
        if req.decision is not None:
            self.picker.on_first_token(req.decision)

    def finished(self, req: SimRequest) -> None:
        if req.decision is not None:
            self.picker.on_finish(req.decision)
            req.decision.hashes = []
        req.hashes, req.final_hashes = [], None  # done with them; thousands of long chains add up
        self.done.append(req)
        if req.on_done is not None:
            cb = req.on_done
            self.at(self.now, lambda: cb(req))

    def run(self, until: float = math.inf, max_events: int | None = None) -> None:
        n = 0
        while self._q and self._q[0][0] <= until:
            t, _, fn = heapq.heappop(self._q)
            self.now = t
            fn()
            n += 1
            if max_events is not None and n >= max_events:
                break
        self.now = max(self.now, until) if until != math.inf else self.now


# ---------------------------------------------------------------------------------------------
# Workloads (closed loop: `concurrency` clients, each waits for its response before the next)


@dataclass
class AgenticWorkload:
    """Coding-agent sessions, shaped like llm-d's published agentic benchmark (inference-perf
    `conversation_replay`): a shared system prompt, an optional per-conversation prompt, then
    turns that each append new input (user message / tool result) to the context, get the model's
    reply appended too, and wait a lognormal tool latency before the next turn. A finished
    session is replaced by a new one (closed loop, as inference-perf's conversation slots)."""

    system_tokens: int = 3000        # shared system prompt (llm-d: 3,000 tokens)
    session_tokens: int = 0          # per-conversation prompt after it (inference-perf's
                                     # dynamic_system_prompt_len; llm-d gives no number)
    first_user_tokens: int = 1500    # new input in the first turn (llm-d: ~1,500 per turn)
    tool_tokens: int = 1500          # new input in every later turn (llm-d: ~1,500 per turn)
    output_tokens: int = 425         # the model's reply per turn (llm-d: 425)
    turns: tuple[int, int] = (5, 15)  # uniform; mean 10 = inference-perf's default turns per conversation
    tool_latency_mean_s: float = 15.0  # lognormal (llm-d: mean 15 s)
    tool_latency_sigma: float = 0.8    # log-space sigma (not published; CV 0.95)

    @property
    def tool_latency_mu(self) -> float:
        return math.log(self.tool_latency_mean_s) - self.tool_latency_sigma ** 2 / 2


@dataclass
class SharedPrefixWorkload:
    """Groups of prompts sharing a long prefix (few-shot templates, RAG over the same document)."""

    groups: int = 64
    prefix_tokens: int = 3000
    suffix_tokens: int = 200
    output_tokens: int = 50
    think_median_s: float = 0.2


@dataclass
class _Session:
    """A conversation's context, kept as its block-hash chain plus the tokens of its trailing partial
    block (whole token lists of thousands of sessions with 30k-token contexts would not fit in memory)."""

    sid: str
    tail: list[int]              # tokens after the last full block
    hashes: list[int]
    turns_left: int
    n_tokens: int = 0

    def extend(self, tokens: list[int], block_size: int) -> None:
        self.n_tokens += len(tokens)
        self.tail.extend(tokens)
        full = len(self.tail) // block_size
        if full:
            self.hashes.extend(block_hashes(self.tail[:full * block_size], block_size,
                                            self.hashes[-1] if self.hashes else 0))
            del self.tail[:full * block_size]


@dataclass
class RunResult:
    requests: list[SimRequest]
    duration_s: float
    warmup_s: float
    decision_latencies: list[float] = field(default_factory=list)
    hit_ratio: float = 0.0
    evicted_blocks: int = 0
    prefill_tokens: int = 0


class _TokenSource:
    """Fresh, globally unique token ids (so distinct content never collides in the hash chain)."""

    def __init__(self, start: int = 1 << 20) -> None:
        self.next = start

    def take(self, n: int) -> list[int]:
        if self.next + n >= 1 << 31:  # ids must fit int32 (the hash packing); wrap far from the
            self.next = 1 << 20          # system prompt ids, reuse is harmless after this long
        out = list(range(self.next, self.next + n))
        self.next += n
        return out


def dedicated_route(sim: Simulator) -> Callable[[SimRequest], str]:
    """The routing no policy can beat on a closed-loop session workload: every session gets a replica
    of its own (the one idle longest when the session starts), so each turn finds its whole context
    cached and shares no step with another session. With 4 replicas per concurrent session, an active
    session's replica is only handed on after ~3x as many other sessions have ended since its last
    turn, i.e. never in practice (checked on the benchmark's runs: no session's replica served
    another session between two of its turns)."""
    idle: OrderedDict[str, None] = OrderedDict((name, None) for name in sim.replicas)
    home: dict[str | None, str] = {}

    def route(req: SimRequest) -> str:
        name = home.get(req.session)
        if name is None:
            name = home[req.session] = next(iter(idle))
        idle.move_to_end(name)
        return name

    return route


def run_agentic(sim: Simulator, wl: AgenticWorkload, concurrency: int, duration_s: float,
                warmup_s: float, seed: int) -> RunResult:
    rng = random.Random(seed)
    src = _TokenSource()
    system = list(range(1000, 1000 + wl.system_tokens))  # the same for every session
    bs = sim.picker.block_size
    system_hashes = block_hashes(system, bs)
    rid = [0]
    mu = wl.tool_latency_mu
    nsess = [0]

    def new_session() -> _Session:
        nsess[0] += 1
        s = _Session(f"s{nsess[0]}", system[len(system_hashes) * bs:], list(system_hashes), rng.randint(*wl.turns),
                     n_tokens=len(system))
        s.extend(src.take(wl.session_tokens + wl.first_user_tokens), bs)
        return s

    def send(s: _Session) -> None:
        if sim.now >= duration_s:
            return
        n_prompt, prompt_hashes = s.n_tokens, list(s.hashes)
        s.extend(src.take(wl.output_tokens), bs)  # the reply, decided now so its blocks can be cached
        rid[0] += 1
        req = SimRequest(rid[0], prompt_hashes, n_prompt, wl.output_tokens, sim.now, s.sid,
                         on_done=lambda r: after(s, r), final_hashes=list(s.hashes))
        sim.submit(req)

    def after(s: _Session, r: SimRequest) -> None:
        s.turns_left -= 1
        if s.turns_left <= 0:
            nxt = new_session()
            sim.at(sim.now + rng.lognormvariate(mu, wl.tool_latency_sigma), lambda: send(nxt))
            return
        s.extend(src.take(wl.tool_tokens), bs)
        sim.at(sim.now + rng.lognormvariate(mu, wl.tool_latency_sigma), lambda: send(s))

    for _ in range(concurrency):
        s = new_session()
        # Start sessions part-way through (history already in the context, caches cold) and at
        # staggered times, so the pool is in steady state after a short warm-up, not in lock-step.
        done = rng.randrange(s.turns_left)
        for _ in range(done):
            s.extend(src.take(wl.output_tokens + wl.tool_tokens), bs)
        s.turns_left -= done
        start = rng.uniform(0, min(warmup_s, 2.0 * wl.tool_latency_mean_s) or 0.01)
        sim.at(start, lambda s=s: send(s))
    sim.run(until=duration_s + 900.0)
    return _result(sim, duration_s, warmup_s)


def run_shared_prefix(sim: Simulator, wl: SharedPrefixWorkload, concurrency: int, duration_s: float,
                      warmup_s: float, seed: int) -> RunResult:
    rng = random.Random(seed)
    src = _TokenSource()
    bs = sim.picker.block_size
    prefixes = [src.take(wl.prefix_tokens) for _ in range(wl.groups)]
    prefix_hashes = [block_hashes(p, bs) for p in prefixes]
    rid = [0]
    mu = math.log(wl.think_median_s)

    def send() -> None:
        if sim.now >= duration_s:
            return
        g = rng.randrange(wl.groups)
        tokens = prefixes[g] + src.take(wl.suffix_tokens)
        full = len(tokens) // bs
        start = len(prefix_hashes[g])
        tail = block_hashes(tokens[start * bs: full * bs], bs, prefix_hashes[g][-1] if start else 0)
        rid[0] += 1
        req = SimRequest(rid[0], prefix_hashes[g] + tail, len(tokens), wl.output_tokens, sim.now,
                         on_done=lambda r: sim.at(sim.now + rng.lognormvariate(mu, 0.5), send))
        sim.submit(req)

    for _ in range(concurrency):
        sim.at(rng.uniform(0, wl.think_median_s), send)
    sim.run(until=duration_s + 900.0)
    return _result(sim, duration_s, warmup_s)


def _result(sim: Simulator, duration_s: float, warmup_s: float) -> RunResult:
    return RunResult(list(sim.done), duration_s, warmup_s,
                     [r.decision_latency_s for r in sim.done], sim.picker.hit_ratio(),
                     sum(r.pool.evicted for r in sim.replicas.values()),
                     sum(r.prefill_tokens for r in sim.replicas.values()))


def summarize(res: RunResult) -> dict[str, float]:
    """TTFT stats over requests that arrived in [warmup, duration); throughput counts tokens of
    requests that finished in the window, divided by the window length."""
    import numpy as np

    win = res.duration_s - res.warmup_s
    arrived = [r for r in res.requests if res.warmup_s <= r.arrival < res.duration_s]
    finished = [r for r in res.requests if res.warmup_s <= r.finish < res.duration_s]
    ttft = np.array([r.ttft for r in arrived]) if arrived else np.array([math.nan])
    prompt = sum(r.n_prompt for r in finished)
    out = sum(r.max_tokens for r in finished)
    cached = sum(r.cached_tokens for r in arrived)
    lat = np.array([r.decision_latency_s for r in arrived]) if arrived else np.array([0.0])
    return {
        "requests": float(len(arrived)),
        "ttft_mean": float(ttft.mean()),
        "ttft_p50": float(np.percentile(ttft, 50)),
        "ttft_p90": float(np.percentile(ttft, 90)),
        "total_tps": (prompt + out) / win,
        "output_tps": out / win,
        "prefix_hit_ratio": cached / max(1, sum(r.n_prompt for r in arrived)),
        "decision_p50_us": float(np.percentile(lat, 50) * 1e6),
        "decision_p99_us": float(np.percentile(lat, 99) * 1e6),
    }
