"""Prometheus metrics of a serving engine (text exposition through prometheus_client).

Everything is computed in the engine thread, after every step and about once a second
while idle: counters, histograms, the rolling one-minute gauges (reject rate, decisions,
accept throughput, verify p99) and the cache health, resource and reload gauges. A scrape
(the event loop) only renders the registry, which prometheus_client locks; it never reads
the engine. Labels: model and device everywhere (and replica under dsrun cluster), tenant
where meaningful.

A step's share stays constant however busy the minute was: the one-minute gauges come from
running sums per tenant (added as rounds arrive, taken off as they leave the minute) and
from a sorted list of the minute's verify times, and every labelled child is looked up
once. Recomputed from the minute at every step, they cost a busy server a large part of
each step (bench/bench_metrics_step.py measures both).
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from dspark.runtime.engine.snapshot import EngineGauges, StepReport
from dspark.runtime.host_load import HostLoad
from dspark.runtime.sequence.request import Sequence

MINUTE = 60.0
HOST_EVERY = 5.0  # seconds between samples of the other processes' CPU use
MS_BUCKETS = (1, 2, 5, 10, 20, 35, 50, 75, 100, 150, 250, 500, 1000, 2500, 5000, 10000)


class Metrics:
    def __init__(self, model: str, device: str, replica: str | None = None):
        """`replica`: the Ray Serve replica this engine is (dsrun cluster), a label on all."""
        self.labels = {"model": model, "device": device}
        if replica is not None:
            self.labels["replica"] = replica
        r = self.registry = CollectorRegistry()
        md = list(self.labels)
        mdt = [*md, "tenant"]
        self.window = Gauge("dflash_window_size_current", "Mean draft window of the last "
                            "minute's rounds", mdt, registry=r)
        self.hit_rate = Gauge("dspar_kv_cache_hit_rate", "Fraction of blocks a verify step "
                              "reads that continue a contiguous run", md, registry=r)
        self.reject = Gauge("dflash_reject_rate_1m", "Rejected / verified draft tokens over "
                            "the last minute", mdt, registry=r)
        self.verify = Histogram("dspar_verify_latency_ms", "Verify forward latency",
                                md, buckets=MS_BUCKETS, registry=r)
        self.verify_p99 = Gauge("dspar_verify_latency_p99_ms", "p99 of the last minute's "
                                "verify forwards", md, registry=r)
        self.decisions = Gauge("dflash_scheduler_decision_count_1m", "Window decisions in the "
                               "last minute", mdt, registry=r)
        self.accept_tps = Gauge("dflash_accept_throughput_tps", "Tokens per second produced "
                                "by verify rounds (accepted drafts + the main model's token) "
                                "over the last minute", mdt, registry=r)
        self.drafted = Counter("dflash_draft_tokens", "Draft tokens verified", mdt, registry=r)
        self.accepted = Counter("dflash_accepted_tokens", "Draft tokens accepted", mdt,
                                registry=r)
        self.accepted_at = Counter("dflash_accepted_tokens_by_position", "Draft tokens "
                                   "accepted, by position in the window", mdt + ["position"],
                                   registry=r)
        self.ttft = Histogram("dflash_ttft_ms", "Time to first token", mdt,
                              buckets=MS_BUCKETS, registry=r)
        self.itl = Histogram("dflash_itl_ms", "Inter-token latency", mdt, buckets=MS_BUCKETS,
                             registry=r)
        self.kv_usage = Gauge("dspar_kv_cache_usage_ratio", "Used / total KV blocks", md,
                              registry=r)
        self.kdr = Gauge("dspar_kv_cache_kdr", "Key density ratio (CHE)", md, registry=r)
        self.vfi = Gauge("dspar_kv_cache_vfi", "Value fragmentation index (CHE)", md,
                         registry=r)
        self.clca = Gauge("dspar_kv_cache_clca", "Cross-layer length spread (CHE)", md,
                          registry=r)
        self.repairs = Gauge("dspar_kv_cache_repairs", "CHE repairs since start", md +
                             ["kind"], registry=r)
        self.degraded = Gauge("dflash_degrade_mode", "1 while RAS has degraded", md,
                              registry=r)
        self.switches = Gauge("dflash_resource_switches", "RAS mode switches since start", md,
                              registry=r)
        self.utilisation = Gauge("dflash_vlb_utilisation", "VLB utilisation", md, registry=r)
        self.reloads = Gauge("dflash_config_reloads", "Config reloads since start, by result",
                             md + ["result"], registry=r)
        self.reload_errors = Gauge("dflash_config_reload_errors_total", "Rejected config "
                                   "reloads since start", md, registry=r)
        self.by_source = Counter("dflash_draft_tokens_by_source", "Draft tokens verified and "
                                 "accepted, by drafting source", mdt + ["source", "result"],
                                 registry=r)
        self.methods = Counter("dflash_draft_method_rounds", "Verify rounds by the drafting "
                               "source used (plain, lookup, draft, lookup+draft)",
                               mdt + ["method"], registry=r)
        self.requests = Counter("dflash_requests", "Requests by endpoint and status",
                                md + ["endpoint", "status"], registry=r)
        self.host_cores = Gauge("dspar_host_other_cores", "CPU cores other processes kept busy "
                                "over the last ~5 s (Linux; with a thread per core, a busy "
                                "core slows every step: DSPARK_THREADS)", md,
                                registry=r)
        self.prefix_queries = Counter("dspark_prefix_cache_queries", "Prompt tokens looked "
                                      "up in the prefix cache", md, registry=r)
        self.prefix_hits = Counter("dspark_prefix_cache_hits", "Prompt tokens found in the "
                                   "prefix cache (their KV not computed again)", md, registry=r)
        self.prefix_rate = Gauge("dspark_prefix_cache_hit_rate", "Prompt tokens found cached "
                                 "/ looked up, since start", md, registry=r)
        self.prefix_blocks = Gauge("dspark_prefix_cache_blocks", "KV blocks of the main model "
                                   "holding a cached prefix (in use or kept for reuse)", md,
                                   registry=r)
        self.evictions = Counter("dspark_prefix_cache_evictions", "Cached blocks evicted to "
                                 "make room", md, registry=r)
        self.copies = Counter("dspark_kv_cache_copies", "Shared KV blocks copied before a "
                              "write (copy on write)", md, registry=r)
        self.counted: dict[int, float] = {}  # engine totals already added to the counters
        self.host, self.host_at = HostLoad(), float("-inf")
        self.host.sample()  # the first step's sample covers the time since start
        self.rounds: deque = deque()  # (time, tenant, window, drafted, accepted)
        self.sums: dict[str, list[int]] = {}  # per tenant: rounds, window, drafted, accepted
        self.verifies: deque = deque()  # (time, ms)
        self.latencies: list[float] = []  # the minute's verify ms, sorted
        self.last_emit: dict[int, float] = {}
        self.metered: dict[int, int] = {}  # tokens already counted per sequence
        self.children: dict[tuple, object] = {}

    def _c(self, metric, *values: str):
        """The child of `metric` for the model's labels then `values` (tenant, ...), made
        once: prometheus_client's labels() costs microseconds a call."""
        key = (id(metric), values)
        child = self.children.get(key)
        if child is None:
            child = self.children[key] = metric.labels(*self.labels.values(), *values)
        return child

    def request(self, endpoint: str, status: str) -> None:
        self.requests.labels(**self.labels, endpoint=endpoint, status=status).inc()

    def on_step(self, report: StepReport, gauges: EngineGauges, seconds: float) -> None:
        """Engine thread, after each step (an empty report between steps when idle)."""
        self.observe(report, gauges, time.perf_counter())

    def observe(self, report: StepReport, gauges: EngineGauges, now: float) -> None:
        """on_step at time `now` (perf_counter seconds)."""
        self._prune(now)
        if report.verify_ms is not None:
            self._c(self.verify).observe(report.verify_ms)
            self.verifies.append((now, report.verify_ms))
            bisect.insort(self.latencies, report.verify_ms)
        for r in report.rounds:
            t = r.tenant
            for i, source in enumerate(r.sources):
                self._c(self.by_source, t, source, "drafted").inc()
                if i < r.accepted:
                    self._c(self.by_source, t, source, "accepted").inc()
            self.rounds.append((now, t, r.window, r.drafted, r.accepted))
            sums = self.sums.setdefault(t, [0, 0, 0, 0])
            sums[0] += 1
            sums[1] += r.window
            sums[2] += r.drafted
            sums[3] += r.accepted
            self._c(self.drafted, t).inc(r.drafted)
            self._c(self.accepted, t).inc(r.accepted)
            for position in range(1, r.accepted + 1):
                self._c(self.accepted_at, t, str(position)).inc()
            self._c(self.methods, t, r.method).inc()
        for seq in report.advanced:
            self._latencies(seq, now)
        self._rolling(now)
        self._state(gauges)
        self._host(now)

    def _host(self, now: float) -> None:
        """The other processes' cores, every HOST_EVERY seconds (a span too short for the
        ticks is read again at the next step; a machine without /proc waits like a read)."""
        if now - self.host_at < HOST_EVERY:
            return
        other = self.host.sample()
        if other is not None:
            self._c(self.host_cores).set(other)
        if other is not None or self.host.last is None:
            self.host_at = now

    def _latencies(self, seq: Sequence, now: float) -> None:
        seen = self.metered.get(seq.id, 0)
        new = len(seq.generated) - seen
        if new > 0:
            t = seq.tenant
            last = self.last_emit.get(seq.id)
            if seen == 0:
                self._c(self.ttft, t).observe(1000 * (seq.first_token_at - seq.submitted))
                new, last = new - 1, seq.first_token_at
            for _ in range(new):  # a verify round emits several tokens at once
                self._c(self.itl, t).observe(1000 * (now - last) / new)
            self.metered[seq.id], self.last_emit[seq.id] = len(seq.generated), now
        if seq.done:
            self.metered.pop(seq.id, None)
            self.last_emit.pop(seq.id, None)

    def render(self) -> bytes:
        """Any thread, on scrape."""
        return generate_latest(self.registry)

    def _state(self, g: EngineGauges) -> None:
        c = self._c
        c(self.hit_rate).set(g.hit_rate)
        c(self.kv_usage).set(g.kv_usage)
        c(self.kdr).set(g.kdr)
        c(self.vfi).set(g.vfi)
        c(self.clca).set(g.clca)
        c(self.repairs, "compaction").set(g.compactions)
        c(self.repairs, "defrag_move").set(g.defrag_moves)
        c(self.degraded).set(int(g.degraded))
        c(self.switches).set(g.switches)
        c(self.utilisation).set(g.utilisation)
        for counter, total in ((self.prefix_queries, g.prefix_queried),
                               (self.prefix_hits, g.prefix_hit), (self.evictions, g.evictions),
                               (self.copies, g.copies)):
            seen, child = self.counted.get(id(counter), 0), c(counter)  # exposed from 0
            if total > seen:
                child.inc(total - seen)
                self.counted[id(counter)] = total
        c(self.prefix_rate).set(g.prefix_hit / g.prefix_queried if g.prefix_queried else 0.0)
        c(self.prefix_blocks).set(g.cached_blocks)
        if g.reloads is not None:
            for result, count in g.reloads:
                c(self.reloads, result).set(count)
            c(self.reload_errors).set(dict(g.reloads)["error"])

    def _prune(self, now: float) -> None:
        """Keep one minute of rounds and verifies (whether or not anyone scrapes), and the
        sums and the sorted verify times that follow them."""
        rounds, verifies = self.rounds, self.verifies
        while rounds and now - rounds[0][0] > MINUTE:
            _, tenant, window, drafted, accepted = rounds.popleft()
            sums = self.sums[tenant]
            sums[0] -= 1
            sums[1] -= window
            sums[2] -= drafted
            sums[3] -= accepted
        while verifies and now - verifies[0][0] > MINUTE:
            ms = verifies.popleft()[1]
            del self.latencies[bisect.bisect_left(self.latencies, ms)]

    def forget(self, seq_id: int) -> None:
        """A cancelled sequence: drop its latency bookkeeping."""
        self.metered.pop(seq_id, None)
        self.last_emit.pop(seq_id, None)

    def _rolling(self, now: float) -> None:
        """The one-minute gauges of each tenant with rounds in the minute (a tenant without
        keeps its last values)."""
        span = max(1.0, min(MINUTE, now - self.rounds[0][0])) if self.rounds else MINUTE
        for tenant, (rounds, window, drafted, accepted) in self.sums.items():
            if not rounds:
                continue
            c = self._c
            c(self.window, tenant).set(window / rounds)
            c(self.reject, tenant).set(1 - accepted / drafted if drafted else 0)
            c(self.decisions, tenant).set(rounds)
            c(self.accept_tps, tenant).set((accepted + rounds) / span)
        latencies = self.latencies
        if latencies:
            p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
            self._c(self.verify_p99).set(p99)
