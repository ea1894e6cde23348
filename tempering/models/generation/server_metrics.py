"""The generation server's ``GET /metrics``: Prometheus text format (``prometheus-client``).

One registry per server (two servers in one process never share counters):

- ``tempering_requests_total{route, status}``, ``tempering_request_latency_seconds{route}``
  (arrival to the last byte of the answer; for a stream, to ``[DONE]``),
- ``tempering_prompt_tokens_total``, ``tempering_completion_tokens_total``,
- ``tempering_queue_depth`` (requests waiting for a backend call), ``tempering_running_rows``
  (rows inside one now), ``tempering_stream_disconnects_total``,
- ``tempering_time_to_first_token_seconds`` and ``tempering_inter_token_latency_seconds``
  (streams: per choice),
- ``tempering_server_events_total{event}``: the chat service's counters (backend calls,
  refusals, ignored fields, cancelled rows, ...), read when scraped.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["CONTENT_TYPE_LATEST", "ServerMetrics"]

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5)


class _ServiceEvents:
    """A collector over the service's counters (``service.stats_snapshot()``)."""

    def __init__(self, service: Any) -> None:
        self.service = service

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily("tempering_server_events", "chat service counters",
                                     labels=["event"])  # fmt: skip
        for key, value in sorted(self.service.stats_snapshot().items()):
            family.add_metric([key], value)
        yield family


class ServerMetrics:
    """The metrics of one server over `service` (module docstring)."""

    def __init__(self, service: Any) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter("tempering_requests", "requests answered", ["route", "status"],
                                registry=r)  # fmt: skip
        self.latency = Histogram("tempering_request_latency_seconds", "arrival to last byte",
                                 ["route"], buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.prompt_tokens = Counter("tempering_prompt_tokens", "prompt tokens", registry=r)
        self.completion_tokens = Counter("tempering_completion_tokens", "generated tokens",
                                         registry=r)  # fmt: skip
        self.disconnects = Counter("tempering_stream_disconnects",
                                   "streams whose client left before [DONE]", registry=r)  # fmt: skip
        self.ttft = Histogram("tempering_time_to_first_token_seconds", "arrival to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)  # fmt: skip
        self.itl = Histogram("tempering_inter_token_latency_seconds", "between tokens of a choice",
                             buckets=_TOKEN_BUCKETS, registry=r)  # fmt: skip
        Gauge("tempering_queue_depth", "requests waiting for a backend call",
              registry=r).set_function(lambda: service.load()["queued"])  # fmt: skip
        Gauge("tempering_running_rows", "rows inside a backend call now",
              registry=r).set_function(lambda: service.load()["running"])  # fmt: skip
        r.register(_ServiceEvents(service))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def answered(self, route: str, status: int, started: float) -> None:
        self.requests.labels(route, str(status)).inc()
        self.latency.labels(route).observe(time.perf_counter() - started)

    def observe_usage(self, results: list[Any]) -> None:
        self.prompt_tokens.inc(len(results[0].prompt_ids))
        self.completion_tokens.inc(sum(len(r.generation_ids) for r in results))

    def disconnected(self) -> None:
        self.disconnects.inc()

    def token_timer(self, started: float) -> _TokenTimer:
        return _TokenTimer(self, started)


class _TokenTimer:
    """TTFT (the request's first token) and inter-token latency per choice of one stream."""

    def __init__(self, metrics: ServerMetrics, started: float) -> None:
        self.metrics, self.started = metrics, started
        self.last: dict[int, float] = {}

    def tick(self, choice: int) -> None:
        now = time.perf_counter()
        if not self.last:
            self.metrics.ttft.observe(now - self.started)
        previous = self.last.get(choice)
        if previous is not None:
            self.metrics.itl.observe(now - previous)
        self.last[choice] = now
