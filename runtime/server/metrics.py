"""Prometheus metrics of a serving engine (text exposition through prometheus_client).

Everything is computed in the engine thread, after every step and about once a second
while idle: counters, histograms, the rolling one-minute gauges (reject rate, decisions,
accept throughput, verify p99) and the cache health, resource and reload gauges. A scrape
(the event loop) only renders the registry, which prometheus_client locks; it never reads
the engine. Labels: model and device everywhere (and replica under dsrun cluster), tenant
where meaningful.
"""

from __future__ import annotations

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
                                "over the last ~5 s (Linux; with a thread per core, one busy "
                                "core of two slowed decoding 1.4-1.8x: DSPARK_THREADS)", md,
                                registry=r)
        self.host, self.host_at = HostLoad(), float("-inf")
        self.host.sample()  # the first step's sample covers the time since start
        self.rounds: deque = deque()  # (time, tenant, window, drafted, accepted)
        self.verifies: deque = deque()  # (time, ms)
        self.last_emit: dict[int, float] = {}
        self.metered: dict[int, int] = {}  # tokens already counted per sequence

    def _t(self, tenant: str) -> dict:
        return {**self.labels, "tenant": tenant}

    def request(self, endpoint: str, status: str) -> None:
        self.requests.labels(**self.labels, endpoint=endpoint, status=status).inc()

    def on_step(self, report: StepReport, gauges: EngineGauges, seconds: float) -> None:
        """Engine thread, after each step (an empty report between steps when idle)."""
        now = time.perf_counter()
        self._prune(now)
        if report.verify_ms is not None:
            self.verify.labels(**self.labels).observe(report.verify_ms)
            self.verifies.append((now, report.verify_ms))
        for r in report.rounds:
            t = self._t(r.tenant)
            for i, source in enumerate(r.sources):
                self.by_source.labels(**t, source=source, result="drafted").inc()
                if i < r.accepted:
                    self.by_source.labels(**t, source=source, result="accepted").inc()
            self.rounds.append((now, r.tenant, r.window, r.drafted, r.accepted))
            self.drafted.labels(**t).inc(r.drafted)
            self.accepted.labels(**t).inc(r.accepted)
            for position in range(1, r.accepted + 1):
                self.accepted_at.labels(**t, position=str(position)).inc()
            self.methods.labels(**t, method=r.method).inc()
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
            self.host_cores.labels(**self.labels).set(other)
        if other is not None or self.host.last is None:
            self.host_at = now

    def _latencies(self, seq: Sequence, now: float) -> None:
        seen = self.metered.get(seq.id, 0)
        new = len(seq.generated) - seen
        if new > 0:
            t = self._t(seq.tenant)
            last = self.last_emit.get(seq.id)
            if seen == 0:
                self.ttft.labels(**t).observe(1000 * (seq.first_token_at - seq.submitted))
                new, last = new - 1, seq.first_token_at
            for _ in range(new):  # a verify round emits several tokens at once
                self.itl.labels(**t).observe(1000 * (now - last) / new)
            self.metered[seq.id], self.last_emit[seq.id] = len(seq.generated), now
        if seq.done:
            self.metered.pop(seq.id, None)
            self.last_emit.pop(seq.id, None)

    def render(self) -> bytes:
        """Any thread, on scrape."""
        return generate_latest(self.registry)

    def _state(self, g: EngineGauges) -> None:
        lab = self.labels
        self.hit_rate.labels(**lab).set(g.hit_rate)
        self.kv_usage.labels(**lab).set(g.kv_usage)
        self.kdr.labels(**lab).set(g.kdr)
        self.vfi.labels(**lab).set(g.vfi)
        self.clca.labels(**lab).set(g.clca)
        self.repairs.labels(**lab, kind="compaction").set(g.compactions)
        self.repairs.labels(**lab, kind="defrag_move").set(g.defrag_moves)
        self.degraded.labels(**lab).set(int(g.degraded))
        self.switches.labels(**lab).set(g.switches)
        self.utilisation.labels(**lab).set(g.utilisation)
        if g.reloads is not None:
            for result, count in g.reloads:
                self.reloads.labels(**lab, result=result).set(count)
            self.reload_errors.labels(**lab).set(dict(g.reloads)["error"])

    def _prune(self, now: float) -> None:
        """Keep one minute of rounds and verifies (whether or not anyone scrapes)."""
        for q in (self.rounds, self.verifies):
            while q and now - q[0][0] > MINUTE:
                q.popleft()

    def forget(self, seq_id: int) -> None:
        """A cancelled sequence: drop its latency bookkeeping."""
        self.metered.pop(seq_id, None)
        self.last_emit.pop(seq_id, None)

    def _rolling(self, now: float) -> None:
        by_tenant: dict[str, list] = {}
        for _, tenant, window, drafted, accepted in self.rounds:
            by_tenant.setdefault(tenant, []).append((window, drafted, accepted))
        for tenant, rounds in by_tenant.items():
            t = self._t(tenant)
            drafted = sum(r[1] for r in rounds)
            self.window.labels(**t).set(sum(r[0] for r in rounds) / len(rounds))
            self.reject.labels(**t).set(1 - sum(r[2] for r in rounds) / drafted if drafted else 0)
            self.decisions.labels(**t).set(len(rounds))
            span = max(1.0, min(MINUTE, now - self.rounds[0][0])) if self.rounds else MINUTE
            self.accept_tps.labels(**t).set(sum(r[2] + 1 for r in rounds) / span)
        latencies = sorted(ms for _, ms in self.verifies)
        if latencies:
            p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))]
            self.verify_p99.labels(**self.labels).set(p99)
