"""A discrete-event simulator of a replica pool behind the real `EndpointPicker`.

Replica model (continuous batching, vLLM-like, no chunked prefill):
  * a FIFO waiting queue; at each step boundary waiting requests are admitted while the batch
    has fewer than `max_batch` sequences and their KV blocks (prompt + max output) fit;
  * a step that admits requests takes decode_step(running) + uncached_prompt_tokens /
    prefill_tps; it gives every running sequence one token and the admitted ones their first;
  * a pure decode step takes decode_base_s + decode_per_seq_s * batch;
  * the prefix cache is an LRU of block hashes sized to `kv_blocks` (the replica's ground truth,
    separate from the router's approximate index); a request's cached tokens are its longest
    cached prefix at admission.

Decode is simulated in epochs (one event per batch change, not per token), so 1,000 replicas
and ~100k requests run in tens of seconds. The router's load table is updated as the simulated
replicas change, i.e. the simulated router sees perfectly fresh metrics (a real router scrapes
with a lag); its own in-flight accounting is exactly the proxy's.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from .index import BlockIndex, block_hashes
from .picker import Decision, EndpointPicker


@dataclass
class ReplicaModel:
    prefill_tps: float = 4000.0        # prompt tokens per second
    decode_base_s: float = 0.025       # decode step time at batch 1 ...
    decode_per_seq_s: float = 0.001    # ... plus this per sequence in the batch
    kv_blocks: int = 4096
    block_size: int = 16
    max_batch: int = 32
    step_overhead_s: float = 0.0       # fixed cost added to a prefill step

    def decode_step(self, batch: int) -> float:
        return self.decode_base_s + self.decode_per_seq_s * batch if batch else 0.0


@dataclass
class SimRequest:
    rid: int
    hashes: list[int]
    n_prompt: int
    max_tokens: int
    arrival: float
    session: str | None = None
    on_done: Callable[[SimRequest], None] | None = None
    # filled in by the simulation
    replica: str = ""
    decision: Decision | None = None
    cached_tokens: int = 0
    generated: int = 0
    first_token: float = math.nan
    finish: float = math.nan
    blocks: int = 0
    decision_latency_s: float = 0.0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival


class SimReplica:
    def __init__(self, name: str, model: ReplicaModel, sim: Simulator) -> None:
        self.name = name
        self.m = model
        self.sim = sim
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.cache = BlockIndex()
        self.cache.add_replica(name, model.kv_blocks)
        self.kv_used = 0
        self.mode = "idle"           # idle | prefill | decode
        self.epoch_start = 0.0
        self.step = 0.0
        self.version = 0
        self.next_event = math.inf

    # -- scheduling ----------------------------------------------------------------------------
    def submit(self, req: SimRequest) -> None:
        self.waiting.append(req)
        now = self.sim.now
        if self.mode == "idle":
            self._schedule(now, self._boundary)
        elif self.mode == "decode" and len(self.running) < self.m.max_batch:
            k = math.ceil((now - self.epoch_start) / self.step - 1e-9)
            t = self.epoch_start + k * self.step
            if t < self.next_event - 1e-12:
                self._schedule(t, self._boundary)
        self._publish()

    def _schedule(self, t: float, fn: Callable[[], None]) -> None:
        self.version += 1
        self.next_event = t
        v = self.version
        self.sim.at(t, lambda: fn() if v == self.version else None)

    def _advance_decode(self) -> None:
        if self.mode == "decode":
            steps = int(round((self.sim.now - self.epoch_start) / self.step))
            for r in self.running:
                r.generated += steps

    def _boundary(self) -> None:
        self._advance_decode()
        self._finish_done()
        self._admit_or_decode()

    def _finish_done(self) -> None:
        now = self.sim.now
        still = []
        for r in self.running:
            if r.generated >= r.max_tokens:
                r.finish = now
                self.kv_used -= r.blocks
                self.sim.finished(r)
            else:
                still.append(r)
        self.running = still

    def _admit_or_decode(self) -> None:
        m = self.m
        admitted: list[SimRequest] = []
        uncached = 0
        while self.waiting and len(self.running) + len(admitted) < m.max_batch:
            r = self.waiting[0]
            need = -(-(r.n_prompt + r.max_tokens) // m.block_size)
            if self.kv_used + need > m.kv_blocks and (self.running or admitted):
                break  # wait for memory; a lone oversized request is admitted anyway
            self.waiting.popleft()
            groups = self.cache.match_groups(r.hashes)
            hit = groups[0][1] if groups else 0
            r.cached_tokens = min(hit * m.block_size, max(0, r.n_prompt - 1))
            uncached += r.n_prompt - r.cached_tokens
            r.blocks = need
            self.kv_used += need
            self.cache.insert(self.name, r.hashes)
            admitted.append(r)
        if admitted:
            self.mode = "prefill"
            dt = m.step_overhead_s + m.decode_step(len(self.running)) + uncached / m.prefill_tps
            self._schedule(self.sim.now + dt, lambda: self._prefill_done(admitted))
        elif self.running:
            self.mode = "decode"
            self.epoch_start = self.sim.now
            self.step = m.decode_step(len(self.running))
            remaining = min(r.max_tokens - r.generated for r in self.running)
            self._schedule(self.sim.now + remaining * self.step, self._boundary)
        else:
            self.mode = "idle"
            self.version += 1
            self.next_event = math.inf
        self._publish()

    def _prefill_done(self, admitted: list[SimRequest]) -> None:
        now = self.sim.now
        for r in self.running:
            r.generated += 1
        for r in admitted:
            r.generated = 1
            r.first_token = now
            self.sim.first_token(r)
        self.running.extend(admitted)
        self.mode = "between"
        self._finish_done()
        self._admit_or_decode()

    def _publish(self) -> None:
        """What a scrape of this replica would report, written straight into the router's table."""
        pool = self.sim.picker.pool
        slot = pool.slots.get(self.name)
        if slot is not None:
            pool.queue[slot] = len(self.waiting)
            pool.running[slot] = len(self.running)
            pool.kv_usage[slot] = min(1.0, self.kv_used / self.m.kv_blocks)


class Simulator:
    """Event loop + pool. Drive it with `submit()` from workload callbacks, then `run(until)`."""

    def __init__(self, picker: EndpointPicker, models: dict[str, ReplicaModel], profile: str | None = None) -> None:
        self.picker = picker
        self.profile = profile
        self.now = 0.0
        self._q: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0
        self.replicas: dict[str, SimReplica] = {}
        self.done: list[SimRequest] = []
        for name, model in models.items():
            self.replicas[name] = SimReplica(name, model, self)
            picker.add_replica(name, kv_blocks=model.kv_blocks)
            slot = picker.pool.slots[name]
            picker.pool.prefill_tps[slot] = model.prefill_tps
            picker.pool.block_size[slot] = model.block_size

    def at(self, t: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        heapq.heappush(self._q, (t, self._seq, fn))

    def submit(self, req: SimRequest) -> None:
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
    """Coding-agent sessions: shared system prompt, a context that grows by a user/tool message
    and the model's reply every turn, lognormal tool latency between turns."""

    system_tokens: int = 4000        # instructions + tool schemas, identical for every session
    first_user_tokens: int = 400
    tool_tokens: int = 500           # tool output (file contents, test logs) before each later turn
    output_tokens: int = 100
    turns: tuple[int, int] = (6, 14)
    tool_latency_median_s: float = 1.0
    tool_latency_sigma: float = 0.8


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
    sid: str
    tokens: list[int]
    hashes: list[int]
    turns_left: int
    hashed_blocks: int = 0


@dataclass
class RunResult:
    requests: list[SimRequest]
    duration_s: float
    warmup_s: float
    decision_latencies: list[float] = field(default_factory=list)
    hit_ratio: float = 0.0


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


def _extend_hashes(s: _Session, block_size: int) -> None:
    full = len(s.tokens) // block_size
    if full > s.hashed_blocks:
        parent = s.hashes[-1] if s.hashes else 0
        tail = s.tokens[s.hashed_blocks * block_size: full * block_size]
        s.hashes.extend(block_hashes(tail, block_size, parent))
        s.hashed_blocks = full


def run_agentic(sim: Simulator, wl: AgenticWorkload, concurrency: int, duration_s: float,
                warmup_s: float, seed: int) -> RunResult:
    rng = random.Random(seed)
    src = _TokenSource()
    system = list(range(1000, 1000 + wl.system_tokens))  # the same for every session
    bs = sim.picker.block_size
    system_hashes = block_hashes(system, bs)
    rid = [0]
    mu = math.log(wl.tool_latency_median_s)
    nsess = [0]

    def new_session() -> _Session:
        nsess[0] += 1
        return _Session(f"s{nsess[0]}", list(system) + src.take(wl.first_user_tokens), list(system_hashes),
                        rng.randint(*wl.turns), hashed_blocks=len(system_hashes))

    def send(s: _Session) -> None:
        if sim.now >= duration_s:
            return
        _extend_hashes(s, bs)
        rid[0] += 1
        req = SimRequest(rid[0], list(s.hashes), len(s.tokens), wl.output_tokens, sim.now, s.sid,
                         on_done=lambda r: after(s, r))
        sim.submit(req)

    def after(s: _Session, r: SimRequest) -> None:
        s.tokens.extend(src.take(r.max_tokens))  # the model's reply joins the context
        s.turns_left -= 1
        if s.turns_left <= 0:
            nxt = new_session()
            sim.at(sim.now + rng.lognormvariate(mu, wl.tool_latency_sigma), lambda: send(nxt))
            return
        s.tokens.extend(src.take(wl.tool_tokens))
        sim.at(sim.now + rng.lognormvariate(mu, wl.tool_latency_sigma), lambda: send(s))

    for _ in range(concurrency):
        s = new_session()
        # Start sessions part-way through (history already in the context, caches cold) and at
        # staggered times, so the pool is in steady state after a short warm-up, not in lock-step.
        done = rng.randrange(s.turns_left)
        for _ in range(done):
            s.tokens.extend(src.take(wl.output_tokens + wl.tool_tokens))
        s.turns_left -= done
        start = rng.uniform(0, min(warmup_s, 2.0 * wl.tool_latency_median_s) or 0.01)
        sim.at(start, lambda s=s: send(s))
    sim.run(until=duration_s + 600.0)
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
    sim.run(until=duration_s + 600.0)
    return _result(sim, duration_s, warmup_s)


def _result(sim: Simulator, duration_s: float, warmup_s: float) -> RunResult:
    return RunResult(list(sim.done), duration_s, warmup_s,
                     [r.decision_latency_s for r in sim.done], sim.picker.hit_ratio())


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
