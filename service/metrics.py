"""Prometheus metrics of the service. Labels are bounded: route templates (unknown paths share one
label), status classes (2xx..5xx), fixed stage names, the configured API keys' names."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics

disable_created_metrics()  # the *_created series only add noise

LATENCY_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
SCORE_BUCKETS = tuple(round(0.1 * i, 1) for i in range(-10, 11))  # cosine: -1.0 to 1.0
STAGES = ("encode", "search", "filter", "lexical", "knowledge", "rerank", "queue_wait")


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "coreply_requests", "HTTP requests by route and status class", ["route", "status"], registry=r
        )
        self.key_requests = Counter(
            "coreply_key_requests",
            "Requests that presented a valid API key, by the key's name and status class",
            ["key", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "coreply_request_duration_seconds",
            "Time from request to response, by route",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.stage = Histogram(
            "coreply_stage_duration_seconds",
            "Time per /respond stage (queue_wait = waiting for a micro-batch to start)",
            ["stage"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.in_flight = Gauge("coreply_in_flight_requests", "Requests being served now", registry=r)
        self.reranked = Histogram(
            "coreply_candidates_reranked",
            "Candidates reranked per /respond request",
            buckets=(0, 1, 5, 10, 20, 50, 100, 200),
            registry=r,
        )
        self.batch_items = Histogram(
            "coreply_batch_requests",
            "Requests served by one micro-batch, per stage",
            ["batcher"],
            buckets=(1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.bundle = Gauge("coreply_bundle_info", "The loaded bundle (value 1)", ["version"], registry=r)
        self.pool = Gauge(
            "coreply_pool_responses",
            "Responses in the loaded bundle's pool: answerable, or withdrawn (`coreply index withdraw`)",
            ["state"],
            registry=r,
        )
        self.ready = Gauge("coreply_ready", "1 when the bundle is loaded and warmed up", registry=r)
        self.cascade_level = Gauge(
            "coreply_cascade_level", "Load-adaptive cascade level (0 = full work)", registry=r
        )
        self.degraded = Counter(
            "coreply_degraded_requests", "Requests answered with less work by the cascade", registry=r
        )
        self.answer_score = Histogram(
            "coreply_answer_retrieval_score",
            "Retrieval score of each answer's first response, before a minimum retrieval score drops it "
            "(cosine for the built-in retriever): where COREPLY_MIN_RETRIEVAL_SCORE would cut, and a fall "
            "when users ask what the pool answers less well",
            buckets=SCORE_BUCKETS,
            registry=r,
        )
        self.fallbacks = Counter(
            "coreply_fallback_responses",
            "Requests answered with the fallback: no response reached the minimum retrieval score",
            registry=r,
        )
        self.reloads = Counter(
            "coreply_reloads",
            "Reloads (SIGHUP) of the bundle, API keys and TLS certificate by result: ok, unchanged or failed",
            ["result"],
            registry=r,
        )
        self.tls_expiry = Gauge(
            "coreply_tls_certificate_expiry_timestamp_seconds",
            "When the TLS certificate served expires, Unix time (0 without HTTPS): a renewal SIGHUP moves it",
            registry=r,
        )
        for stage in STAGES:  # expose every series from the start
            self.stage.labels(stage)
