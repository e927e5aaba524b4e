"""Prometheus metrics under vLLM's names, so that dashboards and routers built for vLLM read them.

Gauges and counters are read from the engine at scrape time (a custom collector); latency histograms
are observed by the engine thread as tokens come out.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from torchbridge.serve.engine import LLMEngine, Request

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


class _EngineCollector:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self):  # noqa: ANN201 - the prometheus_client collector protocol
        eng, name = self.engine, self.model_name
        bm, cfg = eng.block_manager, eng.config

        def gauge(metric: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(metric, doc, labels=["model_name"])
            g.add_metric([name], value)
            return g

        def counter(metric: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(metric, doc, labels=["model_name"])
            c.add_metric([name], value)
            return c

        running = {s.request_id for s in list(eng.scheduler.running)}
        waiting = {s.request_id for s in list(eng.scheduler.waiting)} - running
        yield gauge("vllm:num_requests_running", "Requests with sequences in the running batch.", len(running))
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled.", len(waiting))
        yield gauge("vllm:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = full).", bm.usage)
        yield counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", bm.prefix_queries)
        yield counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.", bm.prefix_hits)
        yield counter("vllm:num_preemptions", "Sequences preempted (recomputed later) for lack of KV blocks.",
                      eng.scheduler.num_preemptions)
        yield counter("vllm:prompt_tokens", "Prompt tokens of admitted requests.", eng.stats.prompt_tokens)
        yield counter("vllm:generation_tokens", "Generated tokens.", eng.stats.generation_tokens)
        # ours (vLLM captures every graph before it serves): shape buckets still to compile while idle
        yield gauge("torchbridge:warmup_pending_buckets", "Shape buckets left to warm up while the engine is idle.",
                    len(eng.warmup_pending))
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "KV-cache configuration.",
            labels=["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        info.add_metric([str(cfg.block_size), str(cfg.num_blocks), str(cfg.enable_prefix_caching)], 1.0)
        yield info
        if eng.proposer is not None:
            st = eng.spec_stats
            # vLLM's v1 counters (its logs derive acceptance rate = accepted / draft tokens and mean
            # acceptance length = 1 + accepted / drafts from them), plus v0's acceptance-rate gauge.
            yield counter("vllm:spec_decode_num_drafts", "Speculative proposals verified.", st.num_drafts)
            yield counter("vllm:spec_decode_num_draft_tokens", "Draft tokens proposed.", st.num_draft_tokens)
            yield counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.", st.num_accepted_tokens)
            per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                          "Draft tokens accepted, by position in the draft.",
                                          labels=["model_name", "position"])
            for i, n in enumerate(st.accepted_per_pos):
                per_pos.add_metric([name, str(i)], n)
            yield per_pos
            yield gauge("vllm:spec_decode_draft_acceptance_rate", "Accepted / proposed draft tokens.",
                        st.acceptance_rate)


class Metrics:
    def __init__(self, engine: LLMEngine, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(engine, model_name))
        self.model_name = model_name

        def hist(metric: str, doc: str) -> Histogram:
            return Histogram(metric, doc, ["model_name"], registry=self.registry, buckets=_LATENCY_BUCKETS)

        self._ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.").labels(model_name)
        self._itl = hist("vllm:inter_token_latency_seconds", "Time between two token emissions.").labels(model_name)
        self._e2e = hist("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.").labels(model_name)
        self._tpot = hist("vllm:time_per_output_token_seconds", "Mean time per output token after the first.").labels(
            model_name
        )
        self._success = Counter("vllm:request_success", "Finished requests.", ["model_name", "finished_reason"],
                                registry=self.registry)
        # vLLM's buckets for it; its count is the engine's steps, its sum the tokens they processed
        self._iteration = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                    ["model_name"], registry=self.registry,
                                    buckets=(1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
                                    ).labels(model_name)
        engine.metrics = self

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def observe_iteration(self, tokens: int) -> None:
        self._iteration.observe(tokens)

    def observe_itl(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def observe_finished(self, request: Request) -> None:
        now = time.monotonic()
        self._e2e.observe(now - request.arrival_time)
        for s in request.seqs:
            if s.first_token_time is not None and s.num_output_tokens > 1:
                self._tpot.observe((now - s.first_token_time) / (s.num_output_tokens - 1))
            self._success.labels(self.model_name, s.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
