"""Prometheus metrics: request counts and latency by route and status, plus engine gauges.

Under ``--api-server-count`` every process counts its own requests and prometheus_client's
multiprocess mode sums them (``PROMETHEUS_MULTIPROC_DIR``, which ``api.api_servers`` sets before
it starts them); the core, which answers /metrics, adds its engine's gauges to the sums.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from tokenwire.engine.base import EngineStats


class Metrics:
    """One registry per app, so several servers in one process never share counters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        # What /metrics renders: this registry, or every process's counts and this one's gauges.
        self._rendered = self.registry
        if "PROMETHEUS_MULTIPROC_DIR" in os.environ:
            self._rendered = CollectorRegistry()
            multiprocess.MultiProcessCollector(self._rendered)
        self.requests = Counter(
            "tokenwire_requests",
            "HTTP requests by route, method and status.",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "tokenwire_request_duration_seconds",
            "HTTP request latency by route (until the response is complete).",
            ["route"],
            registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self._children: dict[tuple[str, str, int], tuple[Any, Any]] = {}
        self.media_cache_hits = Counter(
            "tokenwire_media_cache_hits",
            "Media items served from the cache.",
            ["modality"],
            registry=self.registry,
        )
        self.media_cache_misses = Counter(
            "tokenwire_media_cache_misses",
            "Media items fetched and processed.",
            ["modality"],
            registry=self.registry,
        )

    def observe_request(self, route: str, method: str, status: int, seconds: float) -> None:
        # labels() hashes and locks on every call; the children are cached per label set.
        key = (route, method, status)
        children = self._children.get(key)
        if children is None:
            children = (
                self.requests.labels(route, method, str(status)),
                self.latency.labels(route),
            )
            self._children[key] = children
        children[0].inc()
        children[1].observe(seconds)

    def watch_engine(self, stats: Callable[[], EngineStats | None]) -> None:
        self._rendered.register(_EngineCollector(stats))

    def watch_death(self, dead: Callable[[], bool]) -> None:
        """``tokenwire_engine_dead``: 1 once the engine died (the server is exiting), else 0."""
        self._rendered.register(_DeathCollector(dead))

    def render(self) -> bytes:
        return generate_latest(self._rendered)


class _DeathCollector(Collector):
    def __init__(self, dead: Callable[[], bool]) -> None:
        self.dead = dead

    def collect(self) -> Iterable[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "tokenwire_engine_dead",
            "1 once the engine died (its thread or process); the server then exits non-zero.",
            int(self.dead()),
        )


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats | None]) -> None:
        self.stats = stats

    def collect(self) -> Iterable[GaugeMetricFamily]:
        stats = self.stats()
        if stats is None:
            return
        yield GaugeMetricFamily(
            "tokenwire_engine_running_requests", "Requests in the running batch.", stats.running
        )
        yield GaugeMetricFamily(
            "tokenwire_engine_waiting_requests", "Requests queued for a slot.", stats.waiting
        )
        for name, value in stats.extra.items():
            if isinstance(value, int | float):
                yield GaugeMetricFamily(f"tokenwire_engine_{name}", f"Engine {name}.", value)
