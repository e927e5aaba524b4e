"""The live replica pool: membership, health checks, /metrics scraping and KV-event polling.

It writes what it learns into the picker's load table and precise index; it never decides.
Scraping understands vLLM's metric names (which torchbridge.serve also uses) and SGLang's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .config import RouterConfig
from .metrics import RouterMetrics
from .picker import EndpointPicker

log = logging.getLogger("torchbridge.route")

# Scraped name -> field. Several engines, first match wins per field.
_GAUGES: dict[str, str] = {
    "vllm:num_requests_waiting": "queue",
    "sglang:num_queue_reqs": "queue",
    "vllm:num_requests_running": "running",
    "sglang:num_running_reqs": "running",
    "vllm:kv_cache_usage_perc": "kv_usage",
    "vllm:gpu_cache_usage_perc": "kv_usage",  # vLLM v0 name
    "sglang:token_usage": "kv_usage",
}


def parse_engine_metrics(text: str) -> dict[str, float]:
    """Pick the load numbers out of a Prometheus text exposition.

    Returns a subset of {queue, running, kv_usage, kv_blocks, block_size}; values summed over
    label sets (several models on one server), kv_usage as a fraction in [0, 1].
    """
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = _GAUGES.get(s.name)
            if key is not None:
                out[key] = out.get(key, 0.0) + float(s.value)
            elif s.name == "vllm:cache_config_info":
                for label, key in (("num_gpu_blocks", "kv_blocks"), ("block_size", "block_size")):
                    v = s.labels.get(label)
                    if v not in (None, "", "None"):
                        with contextlib.suppress(ValueError):
                            out[key] = float(v)
    if "kv_usage" in out and out["kv_usage"] > 1.0:  # some exporters report percent
        out["kv_usage"] /= 100.0
    return out


@dataclass
class Replica:
    name: str
    url: str
    healthy: bool = True
    last_error: str = ""
    last_health: float = 0.0
    last_scrape: float = 0.0
    publishes_events: bool | None = None  # None until probed
    events_next: int = 0
    events_seen: int = 0
    engine: dict[str, float] = field(default_factory=dict)

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "healthy": self.healthy, "last_error": self.last_error,
                "kv_events": self.publishes_events, "kv_events_seen": self.events_seen, **self.engine}


class ReplicaPool:
    def __init__(self, cfg: RouterConfig, picker: EndpointPicker, metrics: RouterMetrics,
                 client: httpx.AsyncClient) -> None:
        self.cfg = cfg
        self.picker = picker
        self.metrics = metrics
        self.client = client
        self.replicas: dict[str, Replica] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._probe_tasks: set[asyncio.Task[None]] = set()

    # -- membership --------------------------------------------------------------------------
    def add(self, name: str, url: str) -> Replica:
        if name in self.replicas:
            raise ValueError(f"replica {name!r} already exists")
        rep = Replica(name, url.rstrip("/"))
        self.replicas[name] = rep
        self.picker.add_replica(name)
        self._set_healthy(rep, True)  # optimistic: a failed first request is retried elsewhere
        with contextlib.suppress(RuntimeError):  # no running loop (configured before start)
            t = asyncio.get_running_loop().create_task(self._probe(rep))
            self._probe_tasks.add(t)
            t.add_done_callback(self._probe_tasks.discard)
        return rep

    def remove(self, name: str) -> None:
        self.replicas.pop(name)
        self.picker.remove_replica(name)
        self.metrics.forget_replica(name)

    def get(self, name: str) -> Replica | None:
        return self.replicas.get(name)

    def mark_failed(self, name: str, err: str) -> None:
        """Passive health: a transport failure takes the replica out until a check passes."""
        rep = self.replicas.get(name)
        if rep is not None:
            rep.last_error = err
            self._set_healthy(rep, False)

    def _set_healthy(self, rep: Replica, ok: bool) -> None:
        rep.healthy = ok
        pool = self.picker.pool
        slot = pool.slots.get(rep.name)
        if slot is not None:
            pool.healthy[slot] = ok
        self.metrics.r_healthy.labels(rep.name).set(1 if ok else 0)
        if not ok:
            # A replica that is down has no load to report: drop its last scrape instead of showing it
            # forever; the next successful scrape after it recovers fills them again.
            rep.engine = {}
            if slot is not None:
                pool.queue[slot] = pool.running[slot] = pool.kv_usage[slot] = 0.0
            self.metrics.forget_scraped(rep.name)

    # -- background loops --------------------------------------------------------------------
    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._loop(self.cfg.interval_s, self.check_health)),
            asyncio.create_task(self._loop(self.cfg.scrape_interval_s, self.scrape)),
        ]
        if self.cfg.kv_events:
            self._tasks.append(asyncio.create_task(self._loop(self.cfg.kv_events_interval_s, self.poll_events)))
        if self.cfg.discovery_dns:
            self._tasks.append(asyncio.create_task(self._discovery_loop()))

    async def stop(self) -> None:
        for t in [*self._tasks, *self._probe_tasks]:
            t.cancel()
        for t in [*self._tasks, *self._probe_tasks]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks = []

    async def _loop(self, interval: float, fn: Any) -> None:
        while True:
            reps = list(self.replicas.values())
            await asyncio.gather(*(fn(r) for r in reps), return_exceptions=True)
            await asyncio.sleep(interval)

    async def _discovery_loop(self) -> None:
        while True:
            with contextlib.suppress(OSError):
                await self.discover()
            await asyncio.sleep(self.cfg.discovery_interval_s)

    async def discover(self) -> tuple[list[str], list[str]]:
        """Sync the replicas this pool discovered with the A records of `discovery.dns`.
        Replicas configured by hand or through the admin API are never touched."""
        cfg = self.cfg
        assert cfg.discovery_dns
        infos = await asyncio.get_running_loop().getaddrinfo(cfg.discovery_dns, cfg.discovery_port,
                                                              family=socket.AF_INET, type=socket.SOCK_STREAM)
        want = {f"dns:{info[4][0]}:{cfg.discovery_port}": f"{cfg.discovery_scheme}://{info[4][0]}:{cfg.discovery_port}"
                for info in infos}
        added = [n for n in want if n not in self.replicas]
        removed = [n for n in self.replicas if n.startswith("dns:") and n not in want]
        for n in added:
            self.add(n, want[n])
        for n in removed:
            self.remove(n)
        return added, removed

    async def _probe(self, rep: Replica) -> None:
        await self.check_health(rep)
        await self.scrape(rep)

    async def check_health(self, rep: Replica) -> None:
        try:
            r = await self.client.get(rep.url + "/health", timeout=self.cfg.timeout_s)
            ok = r.status_code == 200
            rep.last_error = "" if ok else f"/health returned {r.status_code}"
        except httpx.HTTPError as e:
            ok = False
            rep.last_error = f"/health: {type(e).__name__}: {e}"
        rep.last_health = time.time()
        if rep.name in self.replicas:
            self._set_healthy(rep, ok)

    async def scrape(self, rep: Replica) -> None:
        if not rep.healthy:  # its gauges stay dropped until a health check passes
            return
        try:
            r = await self.client.get(rep.url + "/metrics", timeout=self.cfg.timeout_s)
            if r.status_code != 200:
                return
            vals = parse_engine_metrics(r.text)
        except (httpx.HTTPError, ValueError) as e:
            log.debug("scrape %s failed: %s", rep.name, e)
            return
        if not rep.healthy or self.replicas.get(rep.name) is not rep:
            return  # marked down (or removed) while this scrape was in flight: its numbers are stale
        rep.engine = vals
        rep.last_scrape = time.time()
        self.apply_engine_metrics(rep.name, vals)

    def apply_engine_metrics(self, name: str, vals: dict[str, float]) -> None:
        pool = self.picker.pool
        slot = pool.slots.get(name)
        if slot is None:
            return
        for key in ("queue", "running", "kv_usage"):
            if key in vals:
                getattr(pool, key)[slot] = vals[key]
        if "kv_blocks" in vals and int(vals["kv_blocks"]) != int(pool.kv_blocks[slot]):
            bs = int(vals.get("block_size", 0)) or None
            self.picker.set_kv_blocks(name, int(vals["kv_blocks"]), bs)
        m = self.metrics
        m.r_queue.labels(name).set(pool.queue[slot])
        m.r_running.labels(name).set(pool.running[slot])
        m.r_kv.labels(name).set(pool.kv_usage[slot])

    async def poll_events(self, rep: Replica) -> None:
        """Feed the precise index from GET /v1/kv_events?since=N (torchbridge.serve's format:
        {"events": [{"id", "type": stored|removed|cleared, "block_hashes", "parent_block_hash",
        "block_size"}], "next": N, "dropped": bool})."""
        if rep.publishes_events is False or not self.picker.tokenizer_exact:
            return
        try:
            r = await self.client.get(rep.url + "/v1/kv_events", params={"since": rep.events_next},
                                      timeout=self.cfg.timeout_s)
        except httpx.HTTPError:
            return
        if r.status_code == 404:
            rep.publishes_events = False  # this engine does not publish; the approx index serves it
            return
        if r.status_code != 200:
            return
        try:
            self.apply_events(rep, r.json())
        except (ValueError, KeyError, TypeError) as e:
            log.warning("bad kv_events payload from %s: %s", rep.name, e)

    def apply_events(self, rep: Replica, payload: dict[str, Any]) -> None:
        idx = self.picker.precise
        pool = self.picker.pool
        slot = pool.slots.get(rep.name)
        if slot is None:
            return
        if payload.get("dropped"):
            idx.clear(slot)  # we missed evictions: forget everything rather than over-claim
        for ev in payload.get("events", []):
            typ = ev.get("type")
            if typ == "stored":
                if int(ev.get("block_size", self.picker.block_size)) != self.picker.block_size:
                    rep.publishes_events = False  # keys cannot match ours; stay approximate
                    pool.precise[slot] = False
                    idx.clear(slot)
                    return
                idx.insert(slot, ev["block_hashes"])
            elif typ == "removed":
                idx.remove(slot, ev["block_hashes"])
                self.picker.approx.remove(slot, ev["block_hashes"])  # correct our guesses too
            elif typ == "cleared":
                idx.clear(slot)
                self.picker.approx.clear(slot)
            rep.events_seen += 1
        rep.events_next = int(payload.get("next", rep.events_next))
        rep.publishes_events = True
        pool.precise[slot] = True
